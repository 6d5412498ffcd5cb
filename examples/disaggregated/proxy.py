"""A small disaggregated-prefill proxy for OpenAI-compatible completions.

POST /v1/completions: the request goes to the prefill server with
``max_tokens=1`` and ``kv_transfer_params={"do_remote_decode": true}``; the
``kv_transfer_params`` it answers with (where the prefill ranks serve their
owned blocks, and the request's transfer token: whoever holds it can fetch
that request's KV, so do not log it) go with the original request to the
decode server, whose answer is returned (streamed as the decode server
streams it where the request says ``"stream": true``). Errors of either side
are passed through with their status.

Both servers get the same ``X-Request-Id`` (the client's, or a new one), so
that vLLM names the request ``cmpl-<id>-0-<suffix>`` on both. vLLM answers a
failed KV transfer with HTTP 500 "Internal server error" only; the proxy then
adds ``kv_transfer_hint``, where the reason is: the decode server's log line
``cp_kv connector: request cmpl-<id>-0-... failed to receive its KV: ...``.

Usage: python proxy.py --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000
"""

import argparse
import contextlib
import uuid

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.background import BackgroundTask

ARGS = None
CLIENT: httpx.AsyncClient | None = None  # one for the proxy's life


@contextlib.asynccontextmanager
async def lifespan(_app):
    # One client, its connections kept alive: a client per request cost
    # 20-35 ms each (httpx builds its TLS context in the constructor), most of
    # what the P/D pair added to a short request.
    global CLIENT
    CLIENT = httpx.AsyncClient(timeout=ARGS.timeout,
                               limits=httpx.Limits(max_keepalive_connections=64))
    try:
        yield
    finally:
        await CLIENT.aclose()


app = FastAPI(lifespan=lifespan)


@app.get("/health")
async def health():
    return {"ok": True}


@app.post("/v1/completions")
async def completions(request: Request):
    body = await request.json()
    prefill_body = dict(body, max_tokens=1, stream=False,
                        kv_transfer_params={"do_remote_decode": True})
    for key in ("max_completion_tokens", "stream_options"):  # the prefill answers whole
        prefill_body.pop(key, None)
    request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
    headers = {"x-request-id": request_id}
    client, d = CLIENT, None
    streaming = False  # then the relay closes the response when the stream ends
    try:
        p = await client.post(f"{ARGS.prefill}/v1/completions", json=prefill_body,
                              headers=headers)
        if p.status_code != 200:
            return JSONResponse(_body(p), status_code=p.status_code)
        kv = p.json().get("kv_transfer_params")
        if not kv:
            return JSONResponse({"error": "prefill server returned no kv_transfer_params"},
                                status_code=502)
        d = await client.send(client.build_request(
            "POST", f"{ARGS.decode}/v1/completions", json=dict(body, kv_transfer_params=kv),
            headers=headers), stream=True)
        if d.status_code == 200 and body.get("stream"):
            streaming = True
            # closed by the relay, or after the response where the client
            # left before the relay started
            return StreamingResponse(_relay(d), media_type=d.headers.get("content-type"),
                                     background=BackgroundTask(d.aclose))
        await d.aread()
        out = _body(d)
    finally:
        if d is not None and not streaming:
            await d.aclose()
    if d.status_code >= 500 and isinstance(out, dict):
        out["kv_transfer_hint"] = (
            "if the KV transfer failed, the decode server's log says why: "
            f"'cp_kv connector: request cmpl-{request_id}-0-... failed to receive its KV'")
    return JSONResponse(out, status_code=d.status_code)


def _body(response: httpx.Response):
    """The answer's JSON, or its text where it is not JSON (a 5xx page):
    the client gets the server's status either way."""
    try:
        return response.json()
    except ValueError:
        return {"error": response.text[:2000]}


async def _relay(response: httpx.Response):
    try:
        async for chunk in response.aiter_raw():
            yield chunk
    finally:
        await response.aclose()


def main():
    global ARGS
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefill", required=True)
    ap.add_argument("--decode", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--timeout", type=float, default=300)
    ARGS = ap.parse_args()
    uvicorn.run(app, host=ARGS.host, port=ARGS.port, log_level="warning")


if __name__ == "__main__":
    main()
