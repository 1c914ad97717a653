"""`ctseg review`'s web server: the batch page, its files, the marks (Starlette, uvicorn).

Every request must carry the server's token: in the link's query (`?token=`, which also
sets a cookie that the page's later requests carry), a header (`X-Ctseg-Token`) or that
cookie; anything else is 403. The server sends only the files its folder's records name
(`ctseg.review.files`), asked for by scan name and kind, never by path. Request bodies
are a mark and a comment: one over `BODY_LIMIT` is refused (413) before it is read whole.

Routes (all under the token):

    GET  /                      the page (static/index.html)
    GET  /static/...            the page's scripts and NiiVue (vendored, served offline)
    GET  /api/batch             the cases in the page's order, the marks, who marks
    PUT  /api/marks/NAME        {"mark": "accept" | "reject" | "needs correction" | null,
                                 "comment": "…"}: saved in OUT/review.json
    GET  /marks.csv             the marks, one row per scan
    GET  /files/NAME/KIND.EXT   a case's labels (seg), preview, scan or reference
"""

from __future__ import annotations

import json
import secrets
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.datastructures import MutableHeaders
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, PlainTextResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ctseg.errors import CtsegError
from ctseg.review.batch import Case, read_batch
from ctseg.review.files import Refused, sendable, served_name
from ctseg.review.marks import BadMark, Marks

STATIC = Path(__file__).parent / "static"
# NiiVue's bundle, kept gzipped (the tracked file stays small) and sent so: browsers
# unpack it themselves.
NIIVUE_GZ = STATIC / "niivue" / "niivue.umd.js.gz"
BODY_LIMIT = 16 << 10  # a mark and a comment of `marks.COMMENT_CHARS`, with room to spare
_NO_STORE = {"Cache-Control": "no-store"}


class _Review:
    """The folder served and the routes' answers: its batch, read again when the page asks
    for it (predictions finished since appear), and its marks."""

    def __init__(self, folder: Path, reviewer: str):
        self.batch = read_batch(folder)
        self.marks = Marks(self.batch.folder, reviewer)

    async def page(self, request: Request) -> Response:
        return FileResponse(STATIC / "index.html", headers=_NO_STORE)

    async def niivue(self, request: Request) -> Response:
        headers = {"Content-Encoding": "gzip", "Cache-Control": "max-age=86400"}
        return Response(NIIVUE_GZ.read_bytes(), media_type="text/javascript", headers=headers)

    def cases(self, request: Request) -> Response:
        try:
            self.batch = current = read_batch(self.batch.folder)  # one assignment
            marks = self.marks.read()
        except CtsegError as exc:
            return JSONResponse({"error": str(exc)}, 409, headers=_NO_STORE)
        return JSONResponse(
            {
                "folder": str(current.folder),
                "kind": current.kind,
                "reviewer": self.marks.reviewer,
                "cases": [_case_json(case) for case in current.cases],
                "marks": {name: mark.to_json() for name, mark in marks.items()},
            },
            headers=_NO_STORE,
        )

    async def save_mark(self, request: Request) -> Response:
        name = request.path_params["name"]
        if self.batch.case(name) is None:
            return _error(404, f"no scan {name!r} in this batch")
        body = await _limited_body(request)
        if body is None:
            return _error(413, f"a mark's request is at most {BODY_LIMIT} bytes")
        try:
            mark, comment = _asked_mark(body)
        except (ValueError, RecursionError) as exc:
            return _error(400, f"the body is not a mark: {exc}"[:200])
        try:
            kept = self.marks.save(name, mark, comment)  # blocking: a short atomic write
        except BadMark as exc:
            return _error(422, str(exc))
        return JSONResponse({"name": name, "mark": kept and kept.to_json()}, headers=_NO_STORE)

    def export(self, request: Request) -> Response:
        names = [case.name for case in self.batch.cases]
        headers = {**_NO_STORE, "Content-Disposition": 'attachment; filename="review.csv"'}
        return Response(self.marks.to_csv(names), media_type="text/csv", headers=headers)

    def file(self, request: Request) -> Response:
        name, asked = request.path_params["name"], request.path_params["file"]
        case = self.batch.case(name)
        if case is None:
            return _error(404, f"no scan {name!r} in this batch")
        try:
            send = sendable(self.batch.folder, case, asked.split(".", 1)[0])
        except Refused as exc:
            return _error(exc.status, str(exc))
        if send.name != asked:
            return _error(404, f"{name}'s file is {send.name}, not {asked}")
        if send.path is not None:
            return FileResponse(send.path, headers=_NO_STORE, filename=None)
        return Response(send.data, media_type="application/octet-stream", headers=_NO_STORE)


def _asked_mark(body: bytes) -> tuple[str | None, str]:
    """The mark and comment a request's body asks for; ValueError if it asks for none."""
    asked = json.loads(body)
    if not isinstance(asked, dict):
        raise ValueError("not an object")
    mark, comment = asked.get("mark"), asked.get("comment", "")
    if not isinstance(comment, str) or not (mark is None or isinstance(mark, str)):
        raise ValueError("mark is a string or null, comment a string")
    return mark, comment


def make_app(folder: Path, token: str, reviewer: str) -> ASGIApp:
    """The review server's application over `folder` (a predict or evaluate folder),
    answering only requests with `token`; CtsegError if the folder holds no batch."""
    review = _Review(folder, reviewer)
    routes = [
        Route("/", review.page),
        Route("/static/niivue.js", review.niivue),
        Mount("/static", StaticFiles(directory=STATIC), name="static"),
        Route("/api/batch", review.cases),
        Route("/api/marks/{name}", review.save_mark, methods=["PUT"]),
        Route("/marks.csv", review.export),
        Route("/files/{name}/{file}", review.file),
    ]
    return _TokenGate(Starlette(routes=routes), token)


def _case_json(case: Case) -> dict[str, Any]:
    """A case as the page reads it: its files as the names to ask for, never as paths."""
    return {**case.to_json(), "files": {k: served_name(k, p) for k, p in case.files.items()}}


def _error(status: int, message: str) -> Response:
    return JSONResponse({"error": message}, status, headers=_NO_STORE)


async def _limited_body(request: Request) -> bytes | None:
    """The request's body, None once it passes `BODY_LIMIT` (said or sent): never read
    whole past it."""
    said = request.headers.get("content-length", "")
    if said.isdigit() and int(said) > BODY_LIMIT:
        return None
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > BODY_LIMIT:
            return None
    return bytes(body)


class _TokenGate:
    """403 for any request without the token; the link's `?token=` sets a cookie (named
    after the port: cookies are per host, not per port, and two servers may run) that the
    page's later requests carry. Every answer says not to sniff types nor to pass the URL
    (with its token) on."""

    def __init__(self, app: ASGIApp, token: str):
        self.app, self.token = app, token.encode()

    def _is_token(self, given: str | None) -> bool:
        return bool(given) and secrets.compare_digest(given.encode(), self.token)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        cookie = f"ctseg-review-{(scope.get('server') or ('', 0))[1]}"
        in_link = self._is_token(request.query_params.get("token"))
        send = _with_headers(send, cookie, self.token.decode() if in_link else None)
        given = (request.headers.get("x-ctseg-token"), request.cookies.get(cookie))
        if not (in_link or any(self._is_token(g) for g in given)):
            answer = PlainTextResponse(
                "403: open the link `ctseg review` printed (it carries the server's token)",
                403,
            )
            await answer(scope, receive, send)
            return
        await self.app(scope, receive, send)


def _with_headers(send: Send, cookie: str, token: str | None) -> Callable[[Message], Awaitable]:
    async def sending(message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = MutableHeaders(scope=message)
            headers["X-Content-Type-Options"] = "nosniff"
            headers["Referrer-Policy"] = "no-referrer"
            if token is not None:
                headers.append("Set-Cookie", f"{cookie}={token}; HttpOnly; SameSite=Strict; Path=/")
        await send(message)

    return sending


LOOPBACK = ("127.0.0.1", "localhost", "::1")


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on `host`:`port` (0: a free port); CtsegError if it cannot be."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise CtsegError(f"cannot listen on {host}: {exc.strerror or exc}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(64)
    except OSError as exc:
        sock.close()
        raise CtsegError(f"cannot listen on {host} port {port}: {exc.strerror or exc}") from None
    return sock


WILDCARDS = ("0.0.0.0", "::", "")


def review_url(host: str, port: int, token: str) -> str:
    """The page's link; for every address of the machine (0.0.0.0), by its name, as other
    machines reach it (browsers refuse 0.0.0.0 itself)."""
    shown = socket.gethostname() if host in WILDCARDS else host
    shown = f"[{shown}]" if ":" in shown else shown
    return f"http://{shown}:{port}/?token={token}"


def serve(sock: socket.socket, app: ASGIApp) -> None:
    """Serve `app` (`make_app`) on the bound `sock` until Ctrl-C (or SIGTERM), which
    uvicorn answers by finishing the requests under way and returning."""
    import uvicorn

    config = uvicorn.Config(
        app, log_level="warning", access_log=False, timeout_graceful_shutdown=3, lifespan="off"
    )
    uvicorn.Server(config).run(sockets=[sock])
