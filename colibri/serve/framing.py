"""HTTP framing errors as OpenAI error objects.

A request uvicorn's HTTP/1.1 parser (h11) cannot read — garbage chunk sizes, a malformed request
line or header — never reaches the app: uvicorn answers 400 itself with a text/plain body
"Invalid HTTP request received." and closes. Every other refusal of `colibri serve` is a JSON
error object (colibri/serve/protocol.py), which OpenAI clients parse; this protocol makes that
one the same. Only the body changes; uvicorn still logs its one warning line.
"""

from __future__ import annotations

import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

FRAMING_ERROR = {"error": {"message": "the request is not valid HTTP/1.1 (its framing is broken: request line, "
                                      "headers or chunked encoding)",
                           "type": "invalid_request_error", "param": None, "code": "invalid_http"}}


class JsonErrorH11Protocol(H11Protocol):
    """uvicorn's h11 protocol whose own 400 answer is a JSON OpenAI error object."""

    def send_400_response(self, msg: str) -> None:
        body = json.dumps(FRAMING_ERROR).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        # h11 refuses to send a response while its state machine holds the broken request
        # (it raised RemoteProtocolError there); a plain HTTP/1.1 response written to the socket is
        # what uvicorn's own httptools protocol does in the same place.
        try:
            out = self.conn.send(h11.Response(status_code=400, headers=headers, reason=b"Bad Request"))
            out += self.conn.send(h11.Data(data=body)) + self.conn.send(h11.EndOfMessage())
        except h11.LocalProtocolError:
            out = (b"HTTP/1.1 400 Bad Request\r\n" + b"".join(k + b": " + v + b"\r\n" for k, v in headers)
                   + b"\r\n" + body)
        self.transport.write(out)
        self.transport.close()
