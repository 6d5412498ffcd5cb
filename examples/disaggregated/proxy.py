"""A small disaggregated-prefill proxy for OpenAI-compatible completions.

POST /v1/completions: the request goes to the prefill server with
``max_tokens=1`` and ``kv_transfer_params={"do_remote_decode": true}``; the
``kv_transfer_params`` it answers with (where the prefill ranks serve their
owned blocks) go with the original request to the decode server, whose answer
is returned. Errors of either side are passed through with their status.

Usage: python proxy.py --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000
"""

import argparse

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

app = FastAPI()
ARGS = None


@app.get("/health")
async def health():
    return {"ok": True}


@app.post("/v1/completions")
async def completions(request: Request):
    body = await request.json()
    prefill_body = dict(body, max_tokens=1, stream=False,
                        kv_transfer_params={"do_remote_decode": True})
    prefill_body.pop("max_completion_tokens", None)
    async with httpx.AsyncClient(timeout=ARGS.timeout) as client:
        p = await client.post(f"{ARGS.prefill}/v1/completions", json=prefill_body)
        if p.status_code != 200:
            return JSONResponse(p.json(), status_code=p.status_code)
        kv = p.json().get("kv_transfer_params")
        if not kv:
            return JSONResponse({"error": "prefill server returned no kv_transfer_params"},
                                status_code=502)
        d = await client.post(f"{ARGS.decode}/v1/completions",
                              json=dict(body, kv_transfer_params=kv))
        return JSONResponse(d.json(), status_code=d.status_code)


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
