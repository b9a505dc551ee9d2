"""The connector's response field over HTTP: POST /v1/completions to a consumer engine serving the tiny model with
the store and identity mapper that experiments/serve/e2e_tiny.py leaves behind (docs/serving.md, "Tests"), and print
each response's status and kv_transfer_params (a manual check; the slow tests run the offline engine).

    python experiments/serve/http_fields.py [--url http://127.0.0.1:8931] [--model models/tiny/qwen3-tiny-3m]
"""
import argparse
import json
import sys
import urllib.error
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
from e2e_tiny import prompts  # noqa: E402


def post(url: str, model: str, ids, params):
    body = {"model": model, "prompt": ids, "max_tokens": 4, "temperature": 0, "kv_transfer_params": params}
    req = urllib.request.Request(f"{url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            out = json.loads(r.read())
            return r.status, out.get("kv_transfer_params"), out["choices"][0]["text"][:30]
    except urllib.error.HTTPError as e:
        return e.code, e.read()[:200], None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8931")
    ap.add_argument("--model", default=str(ROOT / "models" / "tiny" / "qwen3-tiny-3m"))
    a = ap.parse_args()
    ps = prompts()
    for name, params in (("good", {"kvtransfer_tag": "a"}), ("good", {"kvtransfer_source_len": "5"}),
                         ("good", {"kvtransfer_source_len": 2.5}), ("flipped", {}), ("n_layers_two", {}), ("good", {})):
        print(name, params, post(a.url, a.model, ps[name], params))


if __name__ == "__main__":
    main()
