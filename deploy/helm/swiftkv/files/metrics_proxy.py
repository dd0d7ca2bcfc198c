"""A vLLM server's /metrics, and nothing else, on a port of its own (sidecar of each engine server, standard library
only): Prometheus is admitted there, not on the server's API port, where paths vLLM's --api-key leaves open
(/invocations, /tokenize) would answer it too."""

import os
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

UPSTREAM = os.environ.get("METRICS_UPSTREAM", "http://127.0.0.1:8000/metrics")


class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path.split("?")[0] != "/metrics":
            self.send_error(404)
            return
        try:
            with urllib.request.urlopen(UPSTREAM, timeout=10) as r:
                body, ctype = r.read(), r.headers.get("Content-Type", "text/plain")
        except OSError as e:  # the server is starting or down: the scrape fails, as it would on the server itself
            self.send_error(502, str(e))
            return
        self.send_response(200)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):  # one line per scrape would drown the pod's log
        pass


if __name__ == "__main__":
    ThreadingHTTPServer(("0.0.0.0", int(os.environ.get("METRICS_PORT", "8081"))), Handler).serve_forever()
