"""kvtransfer.serve.launch: the three commands one handoff deployment starts, and the launcher itself started and
stopped with stand-in servers (the real engines: tests/test_launch_vllm.py, serving environment)."""
from __future__ import annotations

import ast
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvtransfer.serve import launch


def _args(tmp_path, **kw):
    (tmp_path / "mapper").mkdir(exist_ok=True)
    argv = ["--source", str(tmp_path / "src"), "--target", "Qwen/Qwen2.5-Coder-1.5B-Instruct", "--mapper",
            str(tmp_path / "mapper"), "--store", str(tmp_path / "store"), "--port", "9000",
            "--state-dir", str(tmp_path / "state")]
    for k, v in kw.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    return launch.parser().parse_args(argv)


def _kv(cmd):
    return json.loads(cmd[cmd.index("--kv-transfer-config") + 1])


def test_commands_start_a_producer_a_consumer_and_the_proxy_in_front(tmp_path):
    (tmp_path / "src").mkdir()
    cmds = launch.commands(_args(tmp_path, retention_s=60), python="py")
    src, tgt, proxy = cmds["source"], cmds["target"], cmds["proxy"]
    assert src[:3] == ["py", "-m", "vllm.entrypoints.openai.api_server"] and src[src.index("--port") + 1] == "9001"
    assert tgt[tgt.index("--port") + 1] == "9002" and tgt[tgt.index("--model") + 1] == "Qwen/Qwen2.5-Coder-1.5B-Instruct"
    for cmd in (src, tgt):  # write-through needs the producer's cache, a kept session the consumer's
        assert "--enable-prefix-caching" in cmd and "--enable-prompt-tokens-details" in cmd
    assert _kv(src)["kv_role"] == "kv_producer" and _kv(src)["kv_connector_extra_config"]["store_retention_s"] == "60.0"
    consumer = _kv(tgt)["kv_connector_extra_config"]
    assert _kv(tgt)["kv_role"] == "kv_consumer" and consumer["source_model"] == str((tmp_path / "src").resolve())
    assert consumer["mapper"] == str((tmp_path / "mapper").resolve())
    assert consumer["store"] == _kv(src)["kv_connector_extra_config"]["store"] == str((tmp_path / "store").resolve())
    assert proxy[proxy.index("--source") + 1] == "http://127.0.0.1:9001"
    assert proxy[proxy.index("--target") + 1] == "http://127.0.0.1:9002"
    assert proxy[proxy.index("--mapper") + 1] == consumer["mapper"] and proxy[proxy.index("--port") + 1] == "9000"
    # the context length is each model's own unless asked (the tiny family's is 2,048; a fixed 8,192 was refused)
    assert "--max-model-len" not in src and "--max-model-len" not in tgt and "--chat-template" not in tgt
    # the deployment's secret, logs and stats live in the state directory, not among the store's blocks
    state = (tmp_path / "state").resolve()
    assert proxy[proxy.index("--secret-file") + 1] == str(state / "proxy.secret")
    assert consumer["stats"] == str(state / "consumer_stats.json")
    assert consumer["sink_dir"] == str(state / "sinks")  # a directory store too: the store holds only blocks
    assert _kv(src)["kv_connector_extra_config"]["store_max_bytes"] == str(20 << 30)  # a store is capped by default
    assert "--allow-anonymous-sessions" not in proxy


def test_a_redis_store_url_is_passed_through_and_its_password_travels_in_the_environment(tmp_path):
    (tmp_path / "src").mkdir()
    args = _args(tmp_path)
    args.store = "redis://:p%40ss-7f3a@10.0.0.5:6379/0?deployment=prod"
    cmds = launch.commands(args, python="py")
    for name, cmd in cmds.items():
        assert not [a for a in cmd if "ss-7f3a" in a], name  # never on a command line (ps, logs)
    url = "redis://10.0.0.5:6379/0?deployment=prod"
    src, tgt = _kv(cmds["source"])["kv_connector_extra_config"], _kv(cmds["target"])["kv_connector_extra_config"]
    assert src["store"] == tgt["store"] == url and cmds["proxy"][cmds["proxy"].index("--store") + 1] == url
    assert "store_max_bytes" not in src and "store_max_bytes" not in tgt  # the server's maxmemory caps it
    assert tgt["sink_dir"] == str((tmp_path / "state").resolve() / "sinks")  # this host's, not the store's
    assert launch.store_env(args) == {"KVTRANSFER_REDIS_PASSWORD": "p@ss-7f3a"}
    args.state = "redis://:other@10.0.0.6:6379/0"
    with pytest.raises(SystemExit, match="different passwords"):
        launch.store_env(args)
    args.state = "redis://10.0.0.6:6379/1"
    assert launch.commands(args, python="py")["proxy"][-2:] == ["--state", "redis://10.0.0.6:6379/1"]
    directory = launch.commands(_args(tmp_path), python="py")  # a path stays a resolved path, with its cap
    assert _kv(directory["target"])["kv_connector_extra_config"]["sink_dir"] == str((tmp_path / "state").resolve()
                                                                                    / "sinks")
    assert "--state" not in directory["proxy"] and launch.store_env(_args(tmp_path)) == {}


def test_options_reach_the_commands(tmp_path):
    template = tmp_path / "t.jinja"
    cmds = launch.commands(_args(tmp_path, max_model_len=2048, chat_template=template, store_max_gb=0.5),
                           python="py")
    for cmd in (cmds["source"], cmds["target"]):
        assert cmd[cmd.index("--max-model-len") + 1] == "2048"
        assert cmd[cmd.index("--chat-template") + 1] == str(template.resolve())
    assert _kv(cmds["target"])["kv_connector_extra_config"]["store_max_bytes"] == str(1 << 29)
    argv = ["--source", "a", "--target", "b", "--mapper", "m", "--allow-anonymous-sessions"]
    assert "--allow-anonymous-sessions" in launch.commands(launch.parser().parse_args(argv))["proxy"]


@pytest.mark.parametrize("value", ["2.0", "0", "-1", "half"])
def test_the_kv_space_is_whole_gib_as_vllm_reads_it(value, capsys):
    with pytest.raises(SystemExit):
        launch.parser().parse_args(["--source", "a", "--target", "b", "--mapper", "m", "--kv-space-gb", value])
    assert "--kv-space-gb" in capsys.readouterr().err
    assert launch.parser().parse_args(["--source", "a", "--target", "b", "--mapper", "m"]).kv_space_gb == 2


def test_a_model_without_a_chat_template_gets_a_completions_client(tmp_path):
    tiny = Path(__file__).resolve().parents[1] / "models" / "tiny"
    assert not launch.has_chat_template(str(tiny / "qwen3-tiny-3m"))  # why the template ships beside the family
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    assert launch.has_chat_template(str(tmp_path)) and launch.has_chat_template("Qwen/Qwen3-8B")
    code = launch.client_snippet("127.0.0.1", 8000, "small", "big", chat=False)
    ast.parse(code)
    assert "client.completions.create" in code and "chat" not in code and 'model="big"' in code


def test_a_missing_mapper_is_refused_with_the_command_that_fits_one(tmp_path):
    with pytest.raises(SystemExit, match="run.py pair=<pair> stage=\\[calibrate,fit\\]"):
        launch.main(["--source", "a", "--target", "b", "--mapper", str(tmp_path / "none")])


def test_the_printed_client_is_python_that_names_both_models():
    code = launch.client_snippet("127.0.0.1", 8000, "small", "big")
    ast.parse(code)
    assert 'model="small"' in code and 'model="big"' in code and "X-KVTransfer-Session" in code


STAND_IN = """
import http.server, os, subprocess, sys, time
port, pids = int(sys.argv[1]), sys.argv[2]
worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # an engine's own worker process
with open(pids, "a") as f:
    f.write(f"{os.getpid()} {worker.pid}\\n")
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"{}")
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""

LAUNCHER = """
import sys
from kvtransfer.serve import launch
stand_in, pids = sys.argv[1], sys.argv[2]
def commands(args, python=sys.executable):
    return {name: [python, stand_in, str(args.port + i), pids] for i, name in enumerate(("proxy", "source", "target"))}
launch.commands = commands
launch.main(sys.argv[3:])
"""


def _free_base() -> int:
    """A port p with p, p + 1 and p + 2 free on loopback (as far as one can tell before binding them)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + 2 < 65536 and all(_free(base + i) for i in (1, 2)):
            return base
    raise RuntimeError("no three consecutive free ports")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead: only its parent has not reaped it yet
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_sigterm_stops_the_launcher_and_everything_it_started(tmp_path):
    """systemd, Docker and Kubernetes stop a service with SIGTERM: the launcher must stop its three processes and
    their own children (an engine's workers), not exit and leave them running."""
    (tmp_path / "mapper").mkdir()
    (tmp_path / "mapper" / "mapper.json").write_text("{}")
    (tmp_path / "stand_in.py").write_text(STAND_IN)
    pids = tmp_path / "pids"
    argv = ["--source", "s", "--target", "t", "--mapper", str(tmp_path / "mapper"), "--store", str(tmp_path / "store"),
            "--state-dir", str(tmp_path / "state"), "--port", str(_free_base()), "--timeout", "60"]
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(tmp_path / "stand_in.py"), str(pids), *argv],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path,
                            env=os.environ | {"PYTHONPATH": str(root)})
    out = []
    for line in proc.stdout:
        out.append(line)
        if "The handoff proxy is ready" in line:
            break
    assert "The handoff proxy is ready" in "".join(out), "".join(out) + proc.stdout.read()
    started = [int(x) for x in pids.read_text().split()]
    assert len(started) == 6 and all(_alive(pid) for pid in started)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0, proc.stdout.read()
    deadline = time.time() + 10
    while time.time() < deadline and any(_alive(pid) for pid in started):
        time.sleep(0.1)
    assert [pid for pid in started if _alive(pid)] == [], "left running after SIGTERM"
    assert (tmp_path / "state" / "logs" / "proxy.log").is_file() and not (tmp_path / "store" / "logs").exists()
