"""Run in the lab's outside namespace: download from HOST PORT, print one JSON line with the
byte count, the SHA-256, the longest gap between two receives, every gap over 20 ms (its end on
the system's monotonic clock, and its length), when the last byte came (that clock) and how the
connection ended. It is one TCP
connection from start to end: any reset ends it with an error."""

import hashlib
import json
import socket
import sys
import time

host, port = sys.argv[1], int(sys.argv[2])
sock = socket.create_connection((host, port), timeout=30)
digest, received, longest, error, gaps = hashlib.sha256(), 0, 0.0, None, []
last = start = time.monotonic()
try:
    while True:
        chunk = sock.recv(1 << 16)
        now = time.monotonic()
        if not chunk:
            break
        longest = max(longest, now - last)
        if now - last > 0.02:
            gaps.append([round(now, 3), round(now - last, 3)])
        last = now
        digest.update(chunk)
        received += len(chunk)
except OSError as err:
    error = repr(err)
print(json.dumps({"bytes": received, "sha256": digest.hexdigest(), "longest_stall_s": round(longest, 3),
                  "seconds": round(time.monotonic() - start, 2), "error": error, "gaps": gaps,
                  "last_byte_at": round(last, 3),
                  "local_port": sock.getsockname()[1]}))
