"""The MoE feed-forward block of one decoder layer, at DeepSeek-V4's expert shapes.

Routing is DeepSeek-V3's sigmoid gate (V4's in shape): scores = sigmoid(x @ router) over
E routed experts, computed in float32; each token takes its top-k experts, and their
weights are the chosen scores normalised to sum to 1, times routed_scaling_factor. Left
out, since random weights give them nothing to do: the score-correction bias that only
steers selection (zero at initialisation), group-limited routing, and V4's hash-routed
first layers. The routed experts run in remnant.kernels.moe (a fused Triton kernel that
reads only the routed experts; batched torch on a CPU without Triton's interpreter); the
n_shared_experts shared experts are one dense SwiGLU of n_shared * moe_intermediate_size.

Weights are random and seeded, generated on the CPU in float32 (so every device holds the
same model), with init scale 1/sqrt(fan_in); `.to(device, dtype)` casts the router and the
shared expert to the compute dtype and the routed experts to expert_dtype (FP8 e4m3 codes
with a float32 scale per expert and output column: remnant.kernels.moe.quantize_experts).

remnant.kernels is imported on first use, not here: Triton's interpreter must be chosen
before triton is imported (remnant.kernels.dispatch does the same).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# expert_dtype values (remnant.kernels.moe maps them to torch dtypes): FP8 is the engine's
# choice (V4-Flash keeps its experts in FP4; bf16 experts would be most of a step's bytes and
# hide what an attention mode changes).
from remnant.config import EXPERT_DTYPES
from remnant.engine.ops import silu_mul

COMPUTE_DTYPES = (torch.bfloat16, torch.float32)


@dataclass
class MoEArgs:
    """The MoE block's shape: hidden_size, moe_intermediate_size (I, per expert),
    n_routed_experts (E), num_experts_per_tok (k), n_shared_experts (0: none), the routed
    experts' storage dtype and the factor the routing weights are scaled by."""

    hidden_size: int
    moe_intermediate_size: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int = 1
    expert_dtype: str = "float8_e4m3fn"
    routed_scaling_factor: float = 1.0

    def validate(self) -> None:
        for name in ("hidden_size", "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} is not allowed; allowed: an integer >= 1")
        if not 1 <= self.num_experts_per_tok <= self.n_routed_experts:
            raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} is not allowed; allowed: 1.."
                             f"n_routed_experts={self.n_routed_experts}")
        if not isinstance(self.n_shared_experts, int) or self.n_shared_experts < 0:
            raise ValueError(f"n_shared_experts={self.n_shared_experts!r} is not allowed; allowed: an integer >= 0")
        if self.expert_dtype not in EXPERT_DTYPES:
            raise ValueError(f"expert_dtype={self.expert_dtype!r} is not allowed; allowed: "
                             f"{', '.join(map(repr, EXPERT_DTYPES))}")
        if not (isinstance(self.routed_scaling_factor, (int, float)) and self.routed_scaling_factor > 0
                and math.isfinite(self.routed_scaling_factor)):
            raise ValueError(f"routed_scaling_factor={self.routed_scaling_factor!r} is not allowed; allowed: a "
                             f"finite number > 0")


def expected_distinct_experts(tokens: int, experts: int, k: int) -> float:
    """The expected number of distinct experts that `tokens` tokens hit when each picks k
    of `experts` uniformly at random: experts * (1 - (1 - k / experts) ** tokens) (each
    expert is missed by one token with probability 1 - k/E, independently across tokens).
    Real routers are not uniform, so this is a model of the bytes a decode step reads."""
    if not isinstance(experts, int) or experts < 1:
        raise ValueError(f"experts={experts!r} is not allowed; allowed: an integer >= 1")
    if not isinstance(k, int) or not 1 <= k <= experts:
        raise ValueError(f"k={k!r} is not allowed; allowed: 1..experts={experts}")
    if not isinstance(tokens, int) or tokens < 0:
        raise ValueError(f"tokens={tokens!r} is not allowed; allowed: an integer >= 0")
    return experts * (1.0 - (1.0 - k / experts) ** tokens)


class MoE:
    """Router, E routed SwiGLU experts and an optional shared SwiGLU, of one layer.

    Weights (after .to): router [hidden, E] (the compute dtype's values, held in float32)
    and, with shared experts, shared_gate_up
    [hidden, 2 * S] and shared_down [S, hidden] (S = n_shared * I) in the compute dtype;
    w_gate_up [E, hidden, 2 * I] and w_down [E, I, hidden] in expert_dtype, with
    gate_up_scale float32 [E, 2 * I] and down_scale float32 [E, hidden] for FP8 experts
    (None otherwise). Gate columns come first in each gate_up matrix, then up.
    Constructed: float32 on the generator's device, from `generator` (torch.Generator;
    None: seed 0 on the CPU). A CUDA generator draws a V4-sized MoE in seconds where the
    CPU's would take minutes (its numbers differ from the CPU's for the same seed).
    """

    def __init__(self, hidden_size: int, moe_intermediate_size: int, n_routed_experts: int,
                 num_experts_per_tok: int, n_shared_experts: int = 1, expert_dtype: str = "float8_e4m3fn",
                 routed_scaling_factor: float = 1.0, generator: torch.Generator | None = None):
        self.args = MoEArgs(hidden_size, moe_intermediate_size, n_routed_experts, num_experts_per_tok,
                            n_shared_experts, expert_dtype, routed_scaling_factor)
        self.args.validate()
        gen = generator if generator is not None else torch.Generator().manual_seed(0)
        h, inter, E = hidden_size, moe_intermediate_size, n_routed_experts
        shared = n_shared_experts * inter

        def w(*shape: int, fan_in: int) -> torch.Tensor:
            return torch.randn(*shape, generator=gen, device=gen.device) / math.sqrt(fan_in)

        # Drawn in this order, always: the same generator state gives the same weights.
        self.router = w(h, E, fan_in=h)
        self.w_gate_up = w(E, h, 2 * inter, fan_in=h)
        self.w_down = w(E, inter, h, fan_in=inter)
        self.shared_gate_up = w(h, 2 * shared, fan_in=h) if shared else None
        self.shared_down = w(shared, h, fan_in=shared) if shared else None
        self.gate_up_scale: torch.Tensor | None = None
        self.down_scale: torch.Tensor | None = None
        self.dtype = torch.float32
        self.device = gen.device

    @classmethod
    def from_args(cls, args: MoEArgs, generator: torch.Generator | None = None) -> "MoE":
        return cls(args.hidden_size, args.moe_intermediate_size, args.n_routed_experts, args.num_experts_per_tok,
                   args.n_shared_experts, args.expert_dtype, args.routed_scaling_factor, generator)

    def to(self, device: torch.device | str, dtype: torch.dtype = torch.bfloat16) -> "MoE":
        """Move to `device` with router and shared expert in `dtype` (bfloat16 or float32, the
        compute dtype) and the routed experts in expert_dtype (in place; returns self).

        FP8 experts are quantized once, from the float32 weights, with torch's cast;
        a later .to moves the codes and scales without quantizing again. Experts stored
        in bfloat16 stay so when moved with a float32 compute dtype (and vice versa).
        """
        from remnant.kernels.moe import EXPERT_DTYPES as KERNEL_EXPERT_DTYPES

        if dtype not in COMPUTE_DTYPES:
            raise ValueError(f"dtype={dtype} is not allowed; allowed: {', '.join(map(str, COMPUTE_DTYPES))}")
        device = torch.device(device)
        expert_dtype = KERNEL_EXPERT_DTYPES[self.args.expert_dtype]
        for name in ("router", "shared_gate_up", "shared_down"):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, value.to(device, dtype))
        # Routing multiplies in float32 (route_tokens): the router rounded to the compute
        # dtype, held widened, so a step casts no [hidden, E] matrix per layer.
        self.router = self.router.float()
        self.quantize()
        for name in ("w_gate_up", "w_down"):
            setattr(self, name, getattr(self, name).to(device, expert_dtype))
        for name in ("gate_up_scale", "down_scale"):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, value.to(device))
        self.dtype, self.device = dtype, device
        return self

    def quantize(self) -> "MoE":
        """FP8 experts (expert_dtype float8_e4m3fn): codes and scales from the float weights,
        where they are, once (in place; returns self). Other expert dtypes: nothing."""
        from remnant.kernels.moe import EXPERT_DTYPES as KERNEL_EXPERT_DTYPES, quantize_experts

        if KERNEL_EXPERT_DTYPES[self.args.expert_dtype] == torch.float8_e4m3fn and self.gate_up_scale is None:
            self.w_gate_up, self.gate_up_scale = quantize_experts(self.w_gate_up)
            self.w_down, self.down_scale = quantize_experts(self.w_down)
        return self

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's experts and weights for x [T, hidden] (route_tokens with this block's
        router)."""
        return route_tokens(x, self.router, self.args.num_experts_per_tok, self.args.routed_scaling_factor)

    def _check_input(self, x: torch.Tensor) -> None:
        if x.ndim != 2 or x.shape[1] != self.args.hidden_size:
            raise ValueError(f"x must be [T, hidden_size={self.args.hidden_size}], got {tuple(x.shape)}")

    def forward(self, x: torch.Tensor, impl: str = "auto", route=None, align_pairs=None,
                residual: torch.Tensor | None = None, activation=None) -> torch.Tensor:
        """The block's output [T, hidden] in x's dtype (the compute dtype) for x [T, hidden]:
        routed experts plus the shared expert, plus `residual` [T, hidden] where given, summed
        in float32 and rounded once (in the routed kernels' last launch). No host sync and
        static shapes (CUDA-graph safe). impl: remnant.kernels.moe.routed_experts' choice of
        routed path ("auto": the Triton kernel on CUDA and under Triton's interpreter, batched
        torch otherwise). route, align_pairs, activation: route_tokens,
        remnant.kernels.moe.align and the shared expert's remnant.engine.ops.silu_mul, or the
        same compiled (remnant.engine.step_ops); None: the plain ones."""
        from remnant.kernels.moe import align, routed_experts

        self._check_input(x)
        ids, weights = (route or route_tokens)(x, self.router, self.args.num_experts_per_tok,
                                               self.args.routed_scaling_factor)
        adds = () if self.shared_gate_up is None else (_swiglu(x, self.shared_gate_up, self.shared_down, activation),)
        adds += () if residual is None else (residual,)
        return routed_experts(x, ids, weights, self.w_gate_up, self.w_down, self.gate_up_scale, self.down_scale,
                              impl=impl, align_pairs=align_pairs or align, adds=adds)

    def forward_reference(self, x: torch.Tensor) -> torch.Tensor:
        """forward's ground truth, float64 [T, hidden]: the same routing (route, so both
        take the same experts), the routed experts one token and expert at a time in float64
        (routed_experts_reference) and the shared expert in float64."""
        from remnant.kernels.moe import routed_experts_reference

        self._check_input(x)
        ids, weights = self.route(x)
        y = routed_experts_reference(x, ids, weights, self.w_gate_up, self.w_down, self.gate_up_scale,
                                     self.down_scale)
        if self.shared_gate_up is not None:
            f64 = torch.float64
            y = y + _swiglu(x.to(f64), self.shared_gate_up.to(f64), self.shared_down.to(f64))
        return y

    def weight_bytes(self, distinct_experts: int) -> int:
        """Bytes of weights a forward reads when its tokens hit `distinct_experts` distinct
        routed experts, in the dtypes held now (after .to): the router and the shared expert
        in the compute dtype, and per distinct expert its gate_up and down weights (expert
        dtype) and, for FP8, their float32 scales (2 * I + hidden). A roofline's weight term;
        expected_distinct_experts(T, E, k) gives distinct_experts for T uniform tokens."""
        a = self.args
        if not isinstance(distinct_experts, int) or not 0 <= distinct_experts <= a.n_routed_experts:
            raise ValueError(f"distinct_experts={distinct_experts!r} is not allowed; allowed: 0..n_routed_experts="
                             f"{a.n_routed_experts}")
        compute = self.dtype.itemsize
        h, inter = a.hidden_size, a.moe_intermediate_size
        shared = a.n_shared_experts * inter
        per_expert = 3 * h * inter * self.w_gate_up.element_size()
        if self.gate_up_scale is not None:
            per_expert += (2 * inter + h) * self.gate_up_scale.element_size()
        router = self.router.element_size() * h * a.n_routed_experts
        return router + compute * 3 * h * shared + distinct_experts * per_expert


def route_tokens(x: torch.Tensor, router: torch.Tensor, k: int, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's experts and weights for x [T, hidden]: (topk_ids int64 [T, k],
    topk_weights float32 [T, k], summing to `scaling` per token): the experts of the k
    largest logits x @ router, with the product in float32 (as DeepSeek-V3's gate: close
    scores must not swap experts through bf16 rounding), weighted by sigmoid(logit).
    Ranking logits, not their sigmoids, is the same order without the ties of logits past
    ~17, whose sigmoids round to 1.0 in float32. Graph-safe; remnant.kernels.route is the
    same in two launches."""
    logits, ids = torch.topk(x.float() @ router.float(), k, dim=-1)
    top = torch.sigmoid(logits)
    return ids, top / top.sum(-1, keepdim=True) * scaling


def _swiglu(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, act=None) -> torch.Tensor:
    """silu(x @ gate) * (x @ up) @ down for x [T, hidden], gate_up [hidden, 2 * S] (gate
    columns first), down [S, hidden]; activations rounded to x's dtype between the two.
    act: silu_mul or the same compiled (None: the plain one)."""
    return (act or silu_mul)(x @ gate_up) @ down
