// The VM page: live operation progress and the serial console, both over server-sent events.
(function () {
  const MiB = 1024 * 1024;
  const $ = (id) => document.getElementById(id);
  const mib = (b) => (b / MiB).toFixed(1) + " MiB";
  const rate = (b) => (b / MiB).toFixed(1) + " MiB/s";

  // --- operation progress ---
  const panel = $("operation");
  let settled = null; // the last task whose end has been shown
  const progress = new EventSource(panel.dataset.url);
  progress.onmessage = (msg) => {
    const op = JSON.parse(msg.data).operation;
    if (!op) return;
    const running = op.state !== "SUCCESS" && op.state !== "FAILURE";
    $("op-what").textContent = op.what;
    $("op-state").textContent = running ? "running" : (op.state === "SUCCESS" ? "done" : "failed");
    if ($("cancel")) $("cancel").disabled = !(running && op.what.startsWith("migration"));
    const p = op.progress;
    if (p) {
      const total = p.total_bytes || 0;
      $("progress-bar").style.width = (total ? Math.round(100 * p.processed_bytes / total) : 0) + "%";
      $("p-processed").textContent = mib(p.processed_bytes) + (total ? " of " + mib(total) : "");
      $("p-remaining").textContent = mib(p.remaining_bytes);
      // a VM with a local disk: the disk is copied first, then the memory (and before both,
      // the base image to a site that lacks it)
      $("p-phase").textContent = {base: "sending the base image", disk: "copying the local disk", postcopy: "post-copy"}[p.phase] || "memory (pre-copy)";
      $("p-disk").textContent = p.disk_total_bytes ? mib(p.disk_processed_bytes) + " of " + mib(p.disk_total_bytes) : "-";
      if (p.phase === "disk" || p.phase === "base") {
        $("progress-bar").style.width = Math.round(100 * p.disk_processed_bytes / p.disk_total_bytes) + "%";
      }
      $("p-speed").textContent = rate(p.speed_bps);
      $("p-dirty").textContent = rate(p.dirty_rate_bps);
      $("p-iteration").textContent = p.iteration;
      $("p-limit").textContent = p.downtime_limit_ms == null ? "-" : p.downtime_limit_ms + " ms";
    }
    const events = $("op-events");
    events.innerHTML = "";
    for (const e of op.events || []) {
      const li = document.createElement("li");
      li.textContent = e;
      events.appendChild(li);
    }
    if (!running) {
      const r = op.result || {};
      if (op.state === "SUCCESS") {
        $("progress-bar").style.width = "100%";
        $("op-result").textContent = r.target
          ? `done: ${r.source} → ${r.target}, blackout ${r.downtime_ms ?? "n/a"} ms, total ${r.total_ms} ms`
          : "done";
      } else {
        $("op-result").textContent = "failed: " + op.error;
      }
      if (op.task !== settled) refreshSummary();
      settled = op.task;
    }
  };

  function refreshSummary() {
    const box = $("summary");
    fetch(box.dataset.url, { credentials: "same-origin" })
      .then((r) => (r.ok ? r.text() : null))
      .then((html) => { if (html) { box.innerHTML = html; showTimes(box); } });
  }

  // --- serial console ---
  const box = $("console");
  const term = new Terminal({ convertEol: true, rows: 24, cols: 80, scrollback: 5000,
                              disableStdin: true, fontSize: 13 });
  term.open(box);
  window.vmmgrTerm = term; // for tests: read what the terminal shows
  const out = new EventSource(box.dataset.url);
  out.onmessage = (msg) => {
    const text = JSON.parse(msg.data);
    if (text === null) term.reset(); // a (re)connected stream starts with the backlog again
    else term.write(text);
  };
})();
