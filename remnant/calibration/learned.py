"""Learned retention policy: a per-layer NoPE coordinate scorer trained on captures.

An offline research extension beside the training-free policies
(remnant.calibration.policies), never the serving default: no run config calibrates it at
load; it reaches a server only as a retention map file built from a saved scorer.

Model: per CSA layer, one logit per NoPE coordinate (448 parameters). The map at R keeps
the R - 64 coordinates with the largest logits (remnant.calibration.policies.top, ties to
the lower index), so one scorer serves every retention.

Training (torch, CPU, float32, seeded, a fixed number of steps per layer): at each step, a
seeded sub-sample of one training capture's query tokens (all heads) and records (FP8
quantized and dequantized, as the server stores them) is attended twice, V = K as in
remnant.kv.attention: with every coordinate (the target o) and with the masked keys k * m,
for every R of `retentions`. The mask is a relaxed top-N: m_i = sigmoid((logit_i -
theta_R) / temperature) with theta_R such that sum(m) = N = R - 64, differentiated
implicitly through theta_R, so only a coordinate's importance relative to the others moves
it across a threshold (soft_top_n_mask). The loss is the mean over R and over query
vectors of ||o_masked - o|| / ||o||, the metric remnant.calibration.fidelity reports.
Logits start from a training-free score (default: the log of the attention policy's score,
standardized; `zero` starts from nothing), so a warm start begins at that policy and
training moves coordinates across each threshold only where the training captures say it
lowers the error. (A straight-through hard mask was tried first and fails here: at a kept
coordinate the derivative in m is about rescaling, not about keeping, and training drifted
to drop the important channels.)

File: JSON, `"schema": "remnant/learned-scorer"` (schemas/learned-scorer/v1.schema.json):
per-layer logits, hyperparameters, seed, the training captures (fingerprint, source,
model_id, sizes), per-layer loss curves, created_at and remnant.records.provenance
sources(). Its fingerprint is the sha256 of the file.

Its command is remnant.cli.learned (`python -m remnant.cli.learned train ...`).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from remnant.calibration.captures import Captures, LayerCapture
from remnant.kv.formats import HEAD_DIM, NOPE_DIM, RETENTION_VALUES, ROPE_DIM

#: The training method and its version, as scorer files record it: the name it was first
#: recorded under (this module was remnant.kv.learned), kept so scorers and maps read the same.
METHOD = "remnant.kv.learned/soft-top-n/1"
INITS = ("attention", "magnitude", "zero")
#: Loss-curve points kept per layer (the first step, then means over equal windows).
CURVE_POINTS = 10


@dataclass(frozen=True)
class Hyperparameters:
    """Training settings of a scorer (all recorded in the scorer file).

    steps: optimizer steps per layer. lr: Adam learning rate on the logits.
    temperature: width of the sigmoid surrogate around each threshold, in logit units
    (logits start standardized: mean 0, std 1). queries_per_step: query tokens per step
    (each with all its heads). records_per_step: records per step (the softmax runs over
    them). retentions: the R values whose errors are averaged in the loss (R = 64 keeps
    RoPE only and has no gradient). init: the training-free score the logits start from.
    """

    steps: int = 200
    lr: float = 0.05
    temperature: float = 0.5
    queries_per_step: int = 32
    records_per_step: int = 1024
    retentions: tuple[int, ...] = (128, 192, 256, 320, 384, 448)
    init: str = "attention"

    def check(self) -> None:
        """ValueError naming the field and what is allowed."""
        for name in ("steps", "queries_per_step", "records_per_step"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an integer >= 1")
        for name in ("lr", "temperature"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise ValueError(f"{name}={value!r} must be a number > 0")
        bad = [r for r in self.retentions if r not in RETENTION_VALUES or r == ROPE_DIM]
        if not self.retentions or bad:
            raise ValueError(f"retentions={list(self.retentions)!r} must be a non-empty list of R in "
                             + ", ".join(map(str, RETENTION_VALUES[1:])))
        if self.init not in INITS:
            raise ValueError(f"init={self.init!r} is not allowed; allowed: {', '.join(INITS)}")


@dataclass
class LearnedScorer:
    """Per CSA layer NoPE coordinate logits, with how they were trained.

    layers: model layer index -> float64 [448] logits (larger = kept first).
    training: {"captures": [{"fingerprint", "source", "model_id", "queries", "records"}],
    "loss_curves": {str(layer): [{"step": int, "loss": float}, ...]}}.
    fingerprint: sha256 of the scorer file once saved or loaded (None before).
    """

    model_id: str
    layers: dict[int, torch.Tensor]
    hyperparameters: Hyperparameters
    seed: int
    training: dict
    created_at: str | None = None
    sources: dict | None = field(default=None, repr=False)
    fingerprint: str | None = None
    path: str | None = None

    @property
    def csa_layers(self) -> list[int]:
        """The scorer's layer indices, ascending."""
        return sorted(self.layers)

    def score(self, layer: int) -> torch.Tensor:
        """The logits of `layer`: float64 [448]."""
        if layer not in self.layers:
            raise ValueError(f"{self._name()}: layers has no layer {layer}; the scorer's CSA layers are "
                             f"{self.csa_layers}")
        return self.layers[layer]

    def keep(self, layer: int, retention: int) -> torch.Tensor:
        """Kept NoPE indices of `layer` at R = retention: int64 [R - 64], sorted ascending."""
        from remnant.calibration.policies import top

        if isinstance(retention, bool) or retention not in RETENTION_VALUES:
            raise ValueError(f"retention={retention!r} is not allowed; allowed: "
                             + ", ".join(map(str, RETENTION_VALUES)))
        return top(self.score(layer), retention - ROPE_DIM)

    def check(self, captures: Captures, name: str = "captures") -> None:
        """ValueError naming `name` (the capture file) and the field unless `captures` come
        from the scorer's model (metadata model_id) and hold exactly its CSA layers."""
        if captures.model_id != self.model_id:
            raise ValueError(f"{name}: model_id is {captures.model_id!r}; the scorer {self._name()} was trained "
                             f"on model_id {self.model_id!r}")
        theirs = sorted(captures.layers)
        if theirs != self.csa_layers:
            raise ValueError(f"{name}: layers are {theirs}; the scorer {self._name()} has layers "
                             f"{self.csa_layers}")

    def _name(self) -> str:
        return self.path or "<scorer>"

    def to_dict(self) -> dict:
        """The scorer as a remnant/learned-scorer document (remnant.records.kinds.LEARNED_SCORER)."""
        from remnant.records.kinds import LEARNED_SCORER
        from remnant.records.provenance import sources as code_sources

        hp = asdict(self.hyperparameters)
        hp["retentions"] = list(hp["retentions"])
        return {
            **LEARNED_SCORER.header(),
            "model_id": self.model_id,
            "method": METHOD,
            "hyperparameters": hp,
            "seed": self.seed,
            "training": {"captures": [dict(c) for c in self.training["captures"]],
                         "loss_curves": {str(k): list(v) for k, v in self.training["loss_curves"].items()}},
            "created_at": self.created_at if self.created_at is not None else _now(),
            "sources": dict(self.sources) if self.sources is not None else code_sources(),
            "layers": [{"layer": layer, "logits": [float(x) for x in self.layers[layer].tolist()]}
                       for layer in self.csa_layers],
        }

    @classmethod
    def from_dict(cls, d: dict, source: str = "<document>") -> "LearnedScorer":
        """Validate a remnant/learned-scorer document and build the scorer; RecordError (a
        ValueError) naming `source` and the field, ValueError for a repeated layer."""
        from remnant.records.schema import validate

        validate(d, source=source)
        layers: dict[int, torch.Tensor] = {}
        for i, entry in enumerate(d["layers"]):
            if entry["layer"] in layers:
                raise ValueError(f"{source}: layers[{i}]: layer {entry['layer']} is listed twice")
            layers[int(entry["layer"])] = torch.tensor(entry["logits"], dtype=torch.float64)
        hp = dict(d["hyperparameters"])
        hp["retentions"] = tuple(hp["retentions"])
        return cls(model_id=d["model_id"], layers=layers, hyperparameters=Hyperparameters(**hp),
                   seed=d["seed"], training=dict(d["training"]), created_at=d["created_at"],
                   sources=dict(d["sources"]), path=source)

    def save(self, path: str | os.PathLike) -> Path:
        """Write the scorer as schema-validated JSON (atomically); sets fingerprint and path."""
        from remnant.records.provenance import sha256_file
        from remnant.records.schema import write_validated

        doc = self.to_dict()
        written = write_validated(path, doc)
        self.created_at, self.sources = doc["created_at"], doc["sources"]
        self.fingerprint, self.path = sha256_file(written), str(written)
        return written

    @classmethod
    def load(cls, path: str | os.PathLike) -> "LearnedScorer":
        """Read and check a scorer file; RecordError naming the file for a missing or
        unreadable file, malformed JSON or a schema error."""
        from remnant.records.provenance import sha256_file
        from remnant.records.schema import read_json

        scorer = cls.from_dict(read_json(path, "learned scorer"), source=str(path))
        scorer.fingerprint = sha256_file(path)
        return scorer

    def calibration(self) -> dict:
        """The retention map `calibration` of a map built from this scorer: its training
        captures (one file: that file's fingerprint and source; several: the sha256 of their
        fingerprints joined by newlines, sources joined by '+', and each in `captures`)."""
        import hashlib

        caps = self.training["captures"]
        if len(caps) == 1:
            fingerprint, source = caps[0]["fingerprint"], caps[0]["source"]
        else:
            fingerprint = hashlib.sha256("\n".join(c["fingerprint"] for c in caps).encode()).hexdigest()
            source = "+".join(c["source"] for c in caps)
        out = {"fingerprint": fingerprint, "source": source,
               "queries": min(c["queries"] for c in caps), "records": min(c["records"] for c in caps)}
        if len(caps) > 1:
            out["captures"] = [{k: c[k] for k in ("fingerprint", "source", "queries", "records")} for c in caps]
        return out

    def policy_params(self) -> dict:
        """The retention map `policy.params` of a map built from this scorer."""
        if self.fingerprint is None:
            raise ValueError("the scorer has no fingerprint: save or load it before building a map from it")
        return {"scorer": {"fingerprint": self.fingerprint, "method": METHOD, "seed": self.seed},
                "training_captures": [{"fingerprint": c["fingerprint"], "source": c["source"]}
                                      for c in self.training["captures"]]}


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="milliseconds")


def capture_ref(c: Captures) -> dict:
    """What a scorer (or a fidelity comparison) records of one capture set."""
    return {"fingerprint": c.fingerprint, "source": c.source, "model_id": c.model_id,
            "queries": min(int(x.q.shape[0]) for x in c.layers.values()),
            "records": min(int(x.k.shape[0]) for x in c.layers.values())}


def check_training_set(named: list[tuple[str, Captures]]) -> list[int]:
    """The CSA layers shared by every training capture set; ValueError naming the file and
    field (model_id, layers) where one differs from the first, or a fingerprint repeats."""
    if not named:
        raise ValueError("no training captures given")
    first_name, first = named[0]
    seen = {first.fingerprint: first_name}
    for name, c in named[1:]:
        if c.model_id != first.model_id:
            raise ValueError(f"{name}: model_id is {c.model_id!r}; {first_name} has {first.model_id!r}")
        if sorted(c.layers) != sorted(first.layers):
            raise ValueError(f"{name}: layers are {sorted(c.layers)}; {first_name} has {sorted(first.layers)}")
        if c.fingerprint in seen:
            raise ValueError(f"{name}: the same captures (fingerprint) as {seen[c.fingerprint]}")
        seen[c.fingerprint] = name
    return sorted(first.layers)


def initial_logits(captures: list[LayerCapture], init: str) -> torch.Tensor:
    """Starting logits of one layer, float64 [448]: the standardized log of a training-free
    score averaged over the training captures (zeros for init='zero')."""
    from remnant.calibration.policies import attention_score, magnitude_score

    if init == "zero":
        return torch.zeros(NOPE_DIM, dtype=torch.float64)
    fn = attention_score if init == "attention" else magnitude_score
    score = torch.stack([fn(c) for c in captures]).mean(0)
    logit = torch.log(score.clamp_min(1e-300))
    std = logit.std()
    return (logit - logit.mean()) / (std if std > 0 else 1.0)


@contextlib.contextmanager
def one_thread():
    """Run torch on one CPU thread inside the block, then restore the thread count.

    Training steps and per-token fidelity measurements are small matrices: threads mostly
    wait on each other (15 to 45x slower on a busy 2-core machine than one thread), and one
    thread makes a seed's logits independent of the core count.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _attend(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(512)) k with V = K: q [Q, 512], k [n, 512] -> [Q, 512]."""
    return torch.softmax((q @ k.T) * (1.0 / math.sqrt(HEAD_DIM)), dim=-1) @ k


def soft_top_n_mask(logit: torch.Tensor, n_keep: int, temperature: float) -> torch.Tensor:
    """Relaxed top-n_keep mask [448]: m_i = sigmoid((logit_i - theta) / temperature), theta
    solved so that sum(m) = n_keep. theta is found by bisection without gradient, then
    moved by one Newton step that carries the implicit gradient d theta / d logit_i =
    w_i / sum(w), w = sigmoid'; so raising one logit lowers the others' masks and only
    relative importance moves the ranking. Ranking by m is ranking by logit at every R."""
    if n_keep == 0:
        return torch.zeros_like(logit)
    if n_keep == NOPE_DIM:
        return torch.ones_like(logit)
    x = logit.detach().double()
    lo, hi = float(x.min()) - 40 * temperature, float(x.max()) + 40 * temperature
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        if float(torch.sigmoid((x - mid) / temperature).sum()) > n_keep:
            lo = mid
        else:
            hi = mid
    theta0 = torch.tensor(0.5 * (lo + hi), dtype=logit.dtype)
    m0 = torch.sigmoid((logit - theta0) / temperature)
    w = (m0 * (1 - m0)).detach()
    theta = theta0 + (m0.sum() - n_keep) * temperature / w.sum().clamp_min(1e-30)
    return torch.sigmoid((logit - theta) / temperature)


def batch_loss(logit: torch.Tensor, q: torch.Tensor, k: torch.Tensor, retentions, temperature: float) -> torch.Tensor:
    """Mean over `retentions` and query vectors of ||o_masked - o|| / ||o||, relaxed masks.

    logit: [448]; q: float32 [Q, 512] query vectors; k: float32 [n, 512] (dequantized) records.
    """
    with torch.no_grad():
        target = _attend(q, k)
        norm = target.norm(dim=1).clamp_min(1e-30)
    ones = torch.ones(HEAD_DIM - NOPE_DIM, dtype=logit.dtype)
    total = 0.0
    for r in retentions:
        mask = torch.cat([soft_top_n_mask(logit, r - ROPE_DIM, temperature), ones])
        km = k * mask
        total = total + ((_attend(q, km) - target).norm(dim=1) / norm).mean()
    return total / len(retentions)


def train_layer(captures: list[LayerCapture], hp: Hyperparameters, seed: int, layer: int,
                progress: bool | None = None) -> tuple[torch.Tensor, list[dict]]:
    """Train one layer's logits on its training captures; returns (float64 [448] logits,
    loss curve [{"step", "loss"}]). Step s reads capture s mod len(captures); the sub-samples
    come from torch.Generator seeded with (seed, layer), so a seed gives the same logits."""
    from remnant.kv.codec import dequantize, quantize
    from tqdm import tqdm

    data = [(c.q.float(), dequantize(quantize(c.k.float())).float()) for c in captures]
    g = torch.Generator().manual_seed(seed * 1_000_003 + layer)
    logit = torch.nn.Parameter(initial_logits(captures, hp.init).float())
    opt = torch.optim.Adam([logit], lr=hp.lr)
    losses = []
    with one_thread():
        for step in tqdm(range(hp.steps), desc=f"train layer {layer}", unit="step",
                         disable=None if progress is None else not progress, leave=False):
            q, k = data[step % len(data)]
            ti = torch.randperm(q.shape[0], generator=g)[:hp.queries_per_step]
            ri = torch.randperm(k.shape[0], generator=g)[:hp.records_per_step]
            loss = batch_loss(logit, q[ti].reshape(-1, HEAD_DIM), k[ri], hp.retentions, hp.temperature)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
    return logit.detach().double(), _curve(losses)


def _curve(losses: list[float]) -> list[dict]:
    """The first step's loss, then the mean loss of CURVE_POINTS equal windows of steps."""
    curve = [{"step": 0, "loss": losses[0]}]
    n = len(losses)
    bounds = sorted({max(1, round(n * i / CURVE_POINTS)) for i in range(1, CURVE_POINTS + 1)})
    start = 0
    for end in bounds:
        if end > start:
            window = losses[start:end]
            curve.append({"step": end, "loss": sum(window) / len(window)})
            start = end
    return curve


def train(named: list[tuple[str, Captures]], hp: Hyperparameters = Hyperparameters(), seed: int = 0,
          progress: bool | None = None) -> LearnedScorer:
    """Train a scorer on capture sets [(file name, Captures)], every CSA layer they share.

    ValueError naming the file and field for captures of different models or layers, and
    naming the field for bad hyperparameters.
    """
    hp.check()
    layers = check_training_set(named)
    logits, curves = {}, {}
    for layer in layers:
        caps = [c.layers[layer] for _, c in named]
        for (name, _), cap in zip(named, caps):
            cap.check(f"{name}: layer {layer}")
        logits[layer], curves[layer] = train_layer(caps, hp, seed, layer, progress)
    return LearnedScorer(model_id=named[0][1].model_id, layers=logits, hyperparameters=hp, seed=seed,
                         training={"captures": [capture_ref(c) for _, c in named],
                                   "loss_curves": {str(k): v for k, v in curves.items()}})


def build_map(scorer: LearnedScorer, retention_values: list[int], captures: Captures | None = None,
              captures_name: str = "captures"):
    """Retention map (remnant/retention-map v2, policy learned) of every layer of a saved or
    loaded scorer, one retention per layer in ascending layer order.

    policy.params names the scorer's fingerprint, method and seed and its training
    captures; calibration records the training captures (LearnedScorer.calibration).
    captures, when given, are only checked (model_id and layers, ValueError naming
    `captures_name`): the map does not depend on them.
    """
    from remnant.calibration.retention import LEARNED, LayerKeep, RetentionMap

    if captures is not None:
        scorer.check(captures, captures_name)
    layers = scorer.csa_layers
    if len(retention_values) != len(layers):
        raise ValueError(f"retention_values has {len(retention_values)} values; the scorer has "
                         f"{len(layers)} CSA layers {layers}")
    entries = [LayerKeep(layer=layer, retention=r, keep=scorer.keep(layer, r).tolist())
               for layer, r in zip(layers, retention_values)]
    return RetentionMap(model_id=scorer.model_id, policy=LEARNED, policy_params=scorer.policy_params(),
                        calibration=scorer.calibration(), layers=entries)
