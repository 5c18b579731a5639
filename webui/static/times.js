// Unix timestamps in [data-time] shown as local clock times.
function showTimes(root) {
  for (const el of (root || document).querySelectorAll("[data-time]")) {
    const t = parseFloat(el.dataset.time);
    if (t) el.textContent = new Date(t * 1000).toLocaleTimeString();
  }
}
showTimes();
