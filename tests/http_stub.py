"""A local HTTP stub for the tests of OpenAI-compatible clients (the diversity judge, the served
engine): a threaded server on 127.0.0.1 and a JSON reply helper."""
import contextlib
import http.server
import json
import threading


def send_json(handler: http.server.BaseHTTPRequestHandler, obj, status: int = 200) -> None:
  """Writes ``obj`` as the JSON body of an HTTP ``status`` reply."""
  data = json.dumps(obj).encode()
  handler.send_response(status)
  handler.send_header("Content-Type", "application/json")
  handler.send_header("Content-Length", str(len(data)))
  handler.end_headers()
  handler.wfile.write(data)


@contextlib.contextmanager
def serving(handler_cls, **state):
  """A `ThreadingHTTPServer` running ``handler_cls``; ``state`` becomes server attributes."""
  srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler_cls)
  for k, v in state.items():
    setattr(srv, k, v)
  threading.Thread(target=srv.serve_forever, daemon=True).start()
  try:
    yield srv
  finally:
    srv.shutdown()
    srv.server_close()
