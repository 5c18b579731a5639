"""Run in the lab's outside namespace: accept one connection on PORT, print the peer's address
as a JSON line (what the outside sees), then send it TOOL's stream of MIB MiB at RATE MiB/s."""

import json
import socket
import subprocess
import sys

tool, port, mib, rate = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
listener = socket.create_server(("0.0.0.0", port))
print("listening", flush=True)
conn, peer = listener.accept()
print(json.dumps({"peer": peer[0]}), flush=True)
with subprocess.Popen([tool, mib, rate], stdout=subprocess.PIPE) as gen:
    while chunk := gen.stdout.read(1 << 16):
        conn.sendall(chunk)
conn.close()
