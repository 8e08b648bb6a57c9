"""The load client's ceiling: output tokens/s and requests/s it ingests from a server that
computes nothing, beside SGLang's bench client against the same server in the same run
(`measure`; the command: remnant.cli.ceiling).

Starts `remnant.client.stream_server` (SGLang's /generate frames, no model) pinned to one
CPU; runs each client in its own process pinned to another CPU (where the machine has two
or more), one at a time, alternating their order from round to round so that drift in the
machine's load falls on both. Each client run is one warm-up request then `requests`
measured requests at a fixed concurrency (closed loop), input_ids of `input_len` tokens and
`output_len` output tokens each:

- remnant: `LoadClient` as remnant-run uses it (requests.jsonl written, metrics by
  `remnant.client.metrics.summarize`), in a child process (the command's `--drive`, which
  runs `drive`);
- sglang: `python -m sglang.benchmark.serving --backend sglang --dataset-name random-ids`,
  with the interpreter given by --sglang-python (default: the first that has sglang of this
  one, $REMNANT_SGLANG_PYTHON, the checkout's .sgvenv), its --output-file read back.

Per run it records throughput as each client reports it (total output tokens / measured
duration), and the CPU share of the client and of the server over the server's busy span
after the warm-up (client: /proc/<pid>/stat sampled at 50 Hz; server: its own rusage per
busy period), so a reader can see which side was saturated. The JSON (schema
remnant/client-bench) is validated on write.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

CLIENTS = ("remnant", "sglang")
#: The commands the ceiling starts in child processes: the stream server, and the remnant
#: client (`--drive`, which runs `drive`).
STREAM_SERVER_COMMAND = "remnant.cli.stream_server"
DRIVE_COMMAND = "remnant.cli.ceiling"
_CHECKOUT = Path(__file__).resolve().parents[2]
_TICKS = os.sysconf("SC_CLK_TCK")


# -- the remnant client, in its own process -----------------------------------------------


def drive(base_url: str, requests: int, concurrency: int, input_len: int, output_len: int, out_dir: Path,
          stream: str = "fast") -> dict:
    """One remnant client run: a warm-up request, flush, then `requests` at `concurrency`.

    Returns summarize()'s throughputs and counts, and the stream path the client took.
    """
    from remnant.client.metrics import summarize
    from remnant.client.runner import LoadClient
    from remnant.workloads.base import Phase, PlannedRequest

    out_dir.mkdir(parents=True, exist_ok=True)
    ids = [(7 * i) % 250 + 1 for i in range(input_len)]
    warm = [PlannedRequest("warmup-0", min(output_len, 32), input_ids=ids)]
    measured = [PlannedRequest(f"measured-{i}", output_len, input_ids=ids) for i in range(requests)]
    client = LoadClient(base_url, out_dir / "requests.jsonl", progress=False, stream=stream)
    results = client.run([Phase("warmup", warm, 1), Phase("measured", measured, concurrency)])
    m = summarize(results[1].records, duration_s=results[1].duration_s)
    return {"completed": m["completed"], "failed": m["failed"], "duration_s": m["duration_s"],
            "total_output_tokens": m["total_output_tokens"], "output_throughput": m["output_throughput"],
            "request_throughput": m["request_throughput"], "ttft_p50_ms": m["ttft_ms"]["p50"],
            "stream": client.stream_path}


# -- processes, CPUs ----------------------------------------------------------------------


def _pin(cpu: int | None):
    if cpu is None:
        return None
    return lambda: os.sched_setaffinity(0, {cpu})


def _proc_cpu_s(pid: int) -> float | None:
    """CPU seconds (user + system) of `pid` so far, from /proc; None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _TICKS
    except (OSError, IndexError, ValueError):
        return None


class _Sampler(threading.Thread):
    """(monotonic time, CPU seconds) of a process, every `period_s`, until it ends."""

    def __init__(self, pid: int, period_s: float = 0.02):
        super().__init__(daemon=True)
        self.pid, self.period_s = pid, period_s
        self.samples: list[tuple[float, float]] = []
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            cpu = _proc_cpu_s(self.pid)
            if cpu is None:
                return
            self.samples.append((time.monotonic(), cpu))
            self.halt.wait(self.period_s)

    def cpu_between(self, a: float, b: float) -> float | None:
        """CPU seconds used in [a, b], linearly interpolated between samples."""
        s = self.samples
        if len(s) < 2 or a < s[0][0] or b > s[-1][0]:
            return None

        def at(t: float) -> float:
            for (t0, c0), (t1, c1) in zip(s, s[1:]):
                if t0 <= t <= t1:
                    return c0 if t1 == t0 else c0 + (c1 - c0) * (t - t0) / (t1 - t0)
            return s[-1][1]

        return at(b) - at(a)


def _http(base_url: str, path: str, method: str = "GET") -> dict:
    import httpx

    r = httpx.request(method, base_url + path, timeout=30)
    r.raise_for_status()
    return r.json()


class _Server:
    """The stream server in a child process, pinned to `cpu`."""

    def __init__(self, cpu: int | None, tokenizer_dir: Path, log: Path, incremental: bool):
        cmd = [sys.executable, "-m", STREAM_SERVER_COMMAND, "--port", "0",
               "--tokenizer-dir", str(tokenizer_dir)]
        if cpu is not None:
            cmd += ["--cpu", str(cpu)]
        if incremental:
            cmd.append("--incremental")
        self.log = open(log, "wb")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.log)
        line = self.proc.stdout.readline().strip()
        if not line.isdigit():
            self.stop()
            raise RuntimeError(f"the stream server did not start: {log.read_text()[-2000:]}")
        self.base_url = f"http://127.0.0.1:{int(line)}"

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def _measure(cmd: list[str], cpu: int | None, server: _Server, cwd: Path, env: dict | None = None,
             timeout_s: float = 1800) -> tuple[subprocess.CompletedProcess, _Sampler, list[dict]]:
    """Run a client command pinned to `cpu`, sampling its CPU; returns the process, the
    samples and the server's busy periods during it."""
    _http(server.base_url, "/stats/reset", "POST")
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=_pin(cpu), text=True)
    sampler = _Sampler(proc.pid)
    sampler.start()
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    sampler.halt.set()
    sampler.join()
    periods = _http(server.base_url, "/stats")["periods"]
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err), sampler, periods


def _span(periods: list[dict]) -> tuple[float, float, float] | None:
    """(start, end, server CPU s) of the server's busy span after the warm-up request (a
    first busy period of one request)."""
    ps = sorted(periods, key=lambda p: p["start_s"])
    if ps and ps[0]["requests"] == 1 and len(ps) > 1:
        ps = ps[1:]
    if not ps:
        return None
    return ps[0]["start_s"], ps[-1]["end_s"], sum(p["cpu_s"] for p in ps)


def _shares(sampler: _Sampler, periods: list[dict]) -> dict:
    span = _span(periods)
    if span is None or span[1] <= span[0]:
        return {"client_cpu_share": None, "server_cpu_share": None, "busy_span_s": None}
    a, b, server_cpu = span
    client_cpu = sampler.cpu_between(a, b)
    return {"client_cpu_share": None if client_cpu is None else client_cpu / (b - a),
            "server_cpu_share": server_cpu / (b - a), "busy_span_s": b - a}


@dataclass
class Ceiling:
    """What one ceiling measurement runs: per round, per concurrency, each client's run of
    `requests` measured requests (None: 4 x concurrency, at least 256) of `input_len`
    prompt tokens and `output_len` output tokens. sglang_python: the interpreter of
    SGLang's bench client (None: search, "none": leave it out); stream: the remnant
    client's stream path (fast or httpx); incremental: the server streams only new
    output_ids. description and notes go into the record."""

    concurrency: list[int] = field(default_factory=lambda: [16, 64, 256])
    requests: int | None = None
    input_len: int = 64
    output_len: int = 512
    rounds: int = 3
    clients: list[str] = field(default_factory=lambda: list(CLIENTS))
    sglang_python: str | None = None
    stream: str = "fast"
    incremental: bool = False
    description: str | None = None
    notes: list[str] = field(default_factory=list)


def _per_cpu_s(run: dict) -> float | None:
    """Output tokens per second of the client's CPU: throughput / client CPU share. On a
    machine whose cores other work shares, this is the rate the client would reach with a
    core to itself (if it is CPU-bound), where output_throughput is the rate it got."""
    share = run["client_cpu_share"]
    return run["output_throughput"] / share if share else None


def run_remnant(server: _Server, cpu: int | None, a: Ceiling, requests: int, concurrency: int, work: Path) -> dict:
    out_dir = Path(tempfile.mkdtemp(prefix="remnant-", dir=work))
    cmd = [sys.executable, "-m", DRIVE_COMMAND, "--drive", server.base_url, "--requests", str(requests),
           "--concurrency", str(concurrency), "--input-len", str(a.input_len), "--output-len", str(a.output_len),
           "--drive-dir", str(out_dir), "--stream", a.stream]
    proc, sampler, periods = _measure(cmd, cpu, server, work)
    if proc.returncode != 0:
        raise RuntimeError(f"the remnant client failed (exit {proc.returncode}): {proc.stderr[-3000:]}")
    doc = json.loads(proc.stdout.strip().splitlines()[-1])
    shutil.rmtree(out_dir, ignore_errors=True)
    return {**{k: doc[k] for k in ("completed", "failed", "duration_s", "total_output_tokens", "output_throughput",
                                   "request_throughput", "ttft_p50_ms")}, **_shares(sampler, periods)}


def run_sglang(server: _Server, cpu: int | None, a: Ceiling, python: str, tokenizer_dir: Path, requests: int,
               concurrency: int, work: Path) -> dict:
    out = Path(tempfile.mkdtemp(prefix="sglang-", dir=work)) / "bench.jsonl"
    cmd = [python, "-m", "sglang.benchmark.serving", "--backend", "sglang", "--base-url", server.base_url,
           "--dataset-name", "random-ids", "--num-prompts", str(requests), "--random-input-len", str(a.input_len),
           "--random-output-len", str(a.output_len), "--random-range-ratio", "1", "--max-concurrency",
           str(concurrency), "--request-rate", "inf", "--tokenizer", str(tokenizer_dir), "--model", "ceiling",
           "--warmup-requests", "1", "--disable-tqdm", "--output-file", str(out), "--seed", "1"]
    # HF_HUB_OFFLINE: the client also asks the Hub about the model name (a warning only).
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc, sampler, periods = _measure(cmd, cpu, server, out.parent, env)
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"SGLang's bench client failed (exit {proc.returncode}): "
                           f"{proc.stdout[-1500:]}\n{proc.stderr[-1500:]}")
    doc = json.loads(out.read_text().splitlines()[-1])
    shutil.rmtree(out.parent, ignore_errors=True)
    return {"completed": doc["completed"], "failed": requests - doc["completed"], "duration_s": doc["duration"],
            "total_output_tokens": doc["total_output_tokens"], "output_throughput": doc["output_throughput"],
            "request_throughput": doc["request_throughput"], "ttft_p50_ms": doc["median_ttft_ms"],
            **_shares(sampler, periods)}


def find_sglang_python(given: str | None) -> tuple[str | None, str]:
    """(interpreter, why) for SGLang's bench client: `given`, else the first of this
    interpreter, $REMNANT_SGLANG_PYTHON and the checkout's .sgvenv whose sglang imports
    `sglang.benchmark.serving`; None and the reason where none does."""
    if given == "none":
        return None, "not asked for (--sglang-python none)"
    candidates = [given] if given else [sys.executable, os.environ.get("REMNANT_SGLANG_PYTHON"),
                                        str(_CHECKOUT / ".sgvenv" / "bin" / "python")]
    tried = []
    for py in filter(None, candidates):
        if not Path(py).exists():
            tried.append(f"{py}: missing")
            continue
        probe = subprocess.run([py, "-c", "import sglang.benchmark.serving"], capture_output=True, text=True,
                               timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        if probe.returncode == 0:
            return py, "found"
        tried.append(f"{py}: {(probe.stderr.strip().splitlines() or ['import failed'])[-1][:160]}")
    return None, "no interpreter imports sglang.benchmark.serving (" + "; ".join(tried) + ")"


def _version_in(python: str, dist: str) -> str | None:
    p = subprocess.run([python, "-c", f"import importlib.metadata as m; print(m.version({dist!r}))"],
                       capture_output=True, text=True, timeout=60)
    return p.stdout.strip() or None


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def summarize_runs(runs: list[dict], clients: list[str]) -> list[dict]:
    """Per concurrency: each client's throughputs over rounds (median, min, max) and the
    remnant / sglang ratios of output throughput and of output tokens per client CPU-second,
    paired within each round."""
    out = []
    for c in sorted({r["concurrency"] for r in runs}):
        at = [r for r in runs if r["concurrency"] == c]
        row = {"concurrency": c}
        for name in clients:
            mine = [r for r in at if r["client"] == name]
            row[name] = {"output_throughput": _spread([r["output_throughput"] for r in mine]),
                         "request_throughput": _spread([r["request_throughput"] for r in mine])}
            per_cpu = [r["output_tokens_per_client_cpu_s"] for r in mine if r["output_tokens_per_client_cpu_s"]]
            if per_cpu:
                row[name]["output_tokens_per_client_cpu_s"] = _spread(per_cpu)
        if "remnant" in clients and "sglang" in clients:
            ratios, per_cpu = [], []
            for rnd in sorted({r["round"] for r in at}):
                pair = {r["client"]: r for r in at if r["round"] == rnd}
                if "remnant" in pair and "sglang" in pair:
                    mine, theirs = pair["remnant"], pair["sglang"]
                    ratios.append(mine["output_throughput"] / theirs["output_throughput"])
                    if mine["output_tokens_per_client_cpu_s"] and theirs["output_tokens_per_client_cpu_s"]:
                        per_cpu.append(mine["output_tokens_per_client_cpu_s"] / theirs["output_tokens_per_client_cpu_s"])
            row["ratio_output_throughput"] = _spread(ratios)
            if per_cpu:
                row["ratio_output_tokens_per_client_cpu_s"] = _spread(per_cpu)
        out.append(row)
    return out


def _machine(pinning: dict) -> dict:
    cpu_model = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu_model": cpu_model, "os_cpu_count": os.cpu_count(), "cpus_allowed": sorted(os.sched_getaffinity(0)),
            "platform": platform.platform(), "python": platform.python_version(), "pinning": pinning}


def plot(doc: dict, path: Path) -> None:
    """Output tokens/s against concurrency, each client's runs as points and medians as lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name, color in (("remnant", "tab:blue"), ("sglang", "tab:orange")):
        runs = [r for r in doc["runs"] if r["client"] == name]
        if not runs:
            continue
        ax.scatter([r["concurrency"] for r in runs], [r["output_throughput"] / 1e3 for r in runs], color=color,
                   alpha=0.5, s=14)
        rows = [s for s in doc["summary"] if name in s]
        ax.plot([s["concurrency"] for s in rows], [s[name]["output_throughput"]["median"] / 1e3 for s in rows],
                color=color, marker="o", label=f"{name} client (median of {rows[0][name]['output_throughput']['n']})")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrency (requests in flight)")
    ax.set_ylabel("output tokens/s ingested (thousands)")
    ax.set_ylim(bottom=0)
    w = doc["workload"]
    ax.set_title(f"Client ceiling: model-free stream server, {w['input_len']} in / {w['output_len']} out", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def measure(a: Ceiling) -> dict:
    """Run the measurement `a` describes; the remnant/client-bench document (not yet
    written). Progress, one line per client run, goes to stderr."""
    from remnant.records.kinds import CLIENT_BENCH
    from remnant.records.provenance import environment, sources

    clients = list(dict.fromkeys(a.clients))
    sg_python = sg_why = None
    if "sglang" in clients:
        sg_python, sg_why = find_sglang_python(a.sglang_python)
        if sg_python is None:
            print(f"SGLang's bench client is left out: {sg_why}", file=sys.stderr)
            clients.remove("sglang")

    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) >= 2:
        pinning = {"pinned": True, "server_cpu": cpus[0], "client_cpu": cpus[1], "method": "os.sched_setaffinity",
                   "reason": None}
    else:
        pinning = {"pinned": False, "server_cpu": None, "client_cpu": None, "method": None,
                   "reason": f"this process may use {len(cpus)} CPU; pinning needs 2"}
    load_before = os.getloadavg()
    runs: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="remnant-ceiling-") as tmp:
        work = Path(tmp)
        from remnant.config import ModelConfig
        from remnant.engine.model_dir import write_model_dir
        import dataclasses

        tokenizer_dir = write_model_dir(dataclasses.asdict(ModelConfig()), work / "model")
        server = _Server(pinning["server_cpu"], tokenizer_dir, work / "server.log", a.incremental)
        try:
            for rnd in range(a.rounds):
                for c in a.concurrency:
                    n = a.requests or max(256, 4 * c)
                    order = clients if rnd % 2 == 0 else clients[::-1]
                    for k, name in enumerate(order):
                        if name == "remnant":
                            r = run_remnant(server, pinning["client_cpu"], a, n, c, work)
                        else:
                            r = run_sglang(server, pinning["client_cpu"], a, sg_python, tokenizer_dir, n, c, work)
                        r["output_tokens_per_client_cpu_s"] = _per_cpu_s(r)
                        runs.append({"round": rnd, "order": k, "client": name, "concurrency": c, "requests": n, **r})
                        print(f"round {rnd} C={c} {name}: {r['output_throughput']:,.0f} tok/s "
                              f"{r['request_throughput']:.1f} req/s (client CPU {r['client_cpu_share'] or 0:.2f}, "
                              f"server CPU {r['server_cpu_share'] or 0:.2f})", file=sys.stderr)
        finally:
            server.stop()
    load_after = os.getloadavg()

    summary = summarize_runs(runs, clients)
    limits = [
        "the server computes nothing (remnant.client.stream_server): these are the clients' ceilings on this "
        "machine, not a serving result",
        f"{len(os.sched_getaffinity(0))} CPUs: one for the server, one for the client being measured; the "
        "orchestrator and anything else on the machine share them",
    ]
    busy = [r for r in runs if (r["server_cpu_share"] or 0) > 0.9]
    if busy:
        limits.append(f"{len(busy)} of {len(runs)} runs had the server's CPU above 90 % over its busy span: "
                      "those may be bounded by the server, not the client")
    if any(r["failed"] for r in runs):
        limits.append("some requests failed; throughputs count completed ones only")
    if "sglang" in a.clients and "sglang" not in clients:
        limits.append(f"SGLang's bench client did not run: {sg_why}")
    doc = {
        **CLIENT_BENCH.header(),
        "description": a.description or "client ceiling: remnant's load client"
        + (" and SGLang's bench client" if "sglang" in clients else "") + " against a model-free stream server",
        "created_at": datetime.now(timezone.utc).isoformat(),
        "sources": sources(),
        "environment": environment(),
        "machine": {**_machine(pinning), "load_average_before": list(load_before),
                    "load_average_after": list(load_after)},
        "server": {"module": "remnant.client.stream_server",
                   "output_ids": "incremental" if a.incremental else "cumulative", "text": "cumulative",
                   "text_bytes_per_token": 4},
        "workload": {"input_len": a.input_len, "output_len": a.output_len, "warmup_requests": 1,
                     "rounds": a.rounds, "concurrency": a.concurrency},
        "clients": {
            "remnant": {"stream": a.stream, "python": sys.executable} if "remnant" in clients else None,
            "sglang": {"version": _version_in(sg_python, "sglang"), "python": sg_python,
                       "command": "python -m sglang.benchmark.serving --backend sglang --dataset-name random-ids "
                                  "--random-range-ratio 1 --request-rate inf --max-concurrency C"}
            if "sglang" in clients else None,
        },
        "runs": runs,
        "summary": summary,
        "notes": a.notes,
        "limits": limits,
    }
    return doc
