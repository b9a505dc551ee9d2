"""The connector's response field over HTTP: POST /v1/completions to a consumer started as in
docs/_incoming/issue31a.md (tiny model, the store and identity mapper e2e_tiny.py left in /tmp/i31a_e2e, port 8931)
and print each response's status and kv_transfer_params (a manual check; the slow tests run the offline engine)."""
import json, sys, urllib.request
sys.path.insert(0, "/work/wt-i31a/experiments/serve")
from e2e_tiny import prompts
ps = prompts()
def post(ids, params):
    body = {"model": "/work/wt-i31a/models/tiny/qwen3-tiny-3m", "prompt": ids, "max_tokens": 4, "temperature": 0,
            "kv_transfer_params": params}
    req = urllib.request.Request("http://127.0.0.1:8931/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            out = json.loads(r.read())
            return r.status, out.get("kv_transfer_params"), out["choices"][0]["text"][:30]
    except urllib.error.HTTPError as e:
        return e.code, e.read()[:200], None
for name, params in (("good", {"kvtransfer_tag": "a"}), ("good", {"kvtransfer_source_len": "5"}), ("good", {"kvtransfer_source_len": 2.5}), ("flipped", {}), ("n_layers_two", {}), ("good", {})):
    print(name, params, post(ps[name], params))
