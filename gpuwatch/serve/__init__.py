"""Serve: the daemon's sockets and what carries bytes through them, beside the sinks that render.

`listener` is the one `selectors` loop every listening socket runs on (bounded connections,
timeouts, answers in flight), `connections` what became of each connection; `http_server` is the
metrics port (/metrics, /status, /healthz), `web_config` its web configuration file (basic auth,
headers, reloads) with `tls` (TLS settings, the SSL context), `exposition` the scrape bodies
rendered ahead of the scrapes; `state_socket` serves the status document to the CLI on the
runtime directory's socket, and `state_client` is the CLI's side of it (standard library only).
A server carries what the application layer rendered: it reads no node, judges nothing, renders
no view and acts on nothing (the serve-carries contract in .importlinter).
"""
