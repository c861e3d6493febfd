"""The FFN kinds, `ModelConfig.ffn`: dense, gated (GLU) and mixture of experts, and the
activations they name; each says its hidden width when `ModelConfig.d_ff` is None.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Annotated, Any, Literal, Union

from pydantic import Field, model_validator

from .base import Kind, TinySize, _divisors

if TYPE_CHECKING:
    from .model import ModelConfig


Activation = Literal["relu", "gelu", "gelu-tanh", "gelu-sigmoid", "silu"]


class FFNBase(Kind):
    """Base of the FFN kinds."""

    @property
    def dense(self) -> DenseFFN | GLUFFN:
        """The FFN each token goes through: this one (an MoE: its expert)."""
        return self  # type: ignore[return-value]  # DenseFFN and GLUFFN; MoEFFN overrides it

    def hidden_dim(self, d_model: int) -> int:
        """The hidden width when ModelConfig.d_ff is None (of each expert for MoE): 4·d_model,
        the paper's."""
        return 4 * d_model

    def tiny_layers(self) -> int:
        """The fewest blocks a test-size model needs to hold every kind of block this FFN
        builds (src/attnlab/presets/shrink.py, tiny): one."""
        return 1

    @property
    def label(self) -> str:
        """describe()'s name for it."""
        return self.kind

    @property
    def summary(self) -> str:
        """The components table's words for it (docs/components.md)."""
        return f"{self.kind} {self.dense.activation}"


class DenseFFN(FFNBase):
    """Two linear maps with an activation between (Vaswani et al. 2017, 3.3)."""

    kind: Literal["dense"] = "dense"
    activation: Activation = "relu"
    bias: bool = True


class GLUFFN(FFNBase):
    """Gated linear unit FFN (Shazeer 2020, arXiv:2002.05202): down(act(gate(x)) * up(x)).
    activation "silu" is SwiGLU, "gelu"/"gelu-tanh" is GeGLU. With ModelConfig.d_ff None the
    hidden size is 2/3·4·d_model rounded up to a multiple of `multiple_of` (Llama).

    Clamped GLU (GPT-OSS, huggingface.co/openai/gpt-oss-20b): with `limit` set the gate is
    clamped to at most `limit` and up to [-limit, limit] before the product, and `up_shift` is
    added to up: down(act(min(gate, limit)) · (clamp(up, ±limit) + up_shift)). GPT-OSS's experts
    are limit 7, up_shift 1, activation "gelu-sigmoid" (x·σ(1.702·x))."""

    kind: Literal["glu"] = "glu"
    activation: Activation = "silu"
    bias: bool = False
    multiple_of: int = Field(256, gt=0)
    limit: float | None = Field(None, gt=0)
    up_shift: float = 0.0

    @property
    def summary(self) -> str:
        clamp = f" clamped ±{self.limit:g}" if self.limit is not None else ""
        return f"glu {self.activation}{clamp}" + (
            f", up+{self.up_shift:g}" if self.up_shift else ""
        )

    def hidden_dim(self, d_model: int) -> int:
        """Llama's: 2/3 of 4·d keeps the parameter count of a dense FFN."""
        return self.multiple_of * math.ceil(8 * d_model / 3 / self.multiple_of)

    def tiny(self, size: TinySize) -> GLUFFN:
        """Rounded to multiples of 16."""
        return self.merged(multiple_of=16)


class MoEFFN(FFNBase):
    """Sparse mixture of experts (Shazeer et al. 2017; Switch, Fedus et al. 2021; Mixtral).

    routing: how the router's logits become scores and the chosen experts' weights
    (src/attnlab/nn/ffn/moe.py):
      "topk-softmax"       softmax over the k selected logits (Mixtral, GPT-OSS, Qwen3-MoE with
                           norm_topk_prob; equal to softmax -> top-k -> renormalise)
      "softmax-topk"       softmax over all experts, the top k probabilities unnormalised
                           (Switch, DeepSeekMoE / V2, Qwen-MoE with norm_topk_prob False)
      "sigmoid-topk"       σ(logit) per expert, the top k unnormalised (DeepSeek-V3 with
                           norm_topk_prob False)
      "sigmoid-topk-norm"  σ(logit) per expert, the top k divided by their sum (DeepSeek-V3)
    The load-balancing loss (`balance_loss`) times `aux_loss_coef` is returned in
    ModelOutput.aux_loss: "switch" over the whole batch (Switch eq. 4), "sequence" per sequence
    and divided by top_k, DeepSeek-V2's expert-level loss (arXiv:2405.04434, eq. 23-25; with
    sigmoid scores V3's complementary loss, arXiv:2412.19437 eq. 17-20).

    Router: `router_bias` gives the router's linear map a bias (GPT-OSS). `selection_bias` adds
    a per-expert bias (a buffer, loaded or adjusted between steps, not learned by gradient) to
    the scores for choosing the experts only, the weights use the uncorrected scores
    (auxiliary-loss-free balancing, Wang et al. 2024, arXiv:2408.15664; DeepSeek-V3's
    e_score_correction_bias).

    DeepSeek's routing: `routed_scale` multiplies the routed experts' weights
    (routed_scaling_factor); n_groups > 1 limits each token to the experts of its
    `top_k_groups` best groups, a group scored by `group_score`: "max", its best expert's score
    (V2's group_limited_greedy), or "top2-sum", the sum of its two best (bias-corrected) scores
    (V3's noaux_tc). The first `dense_layers` blocks of a stack get one dense FFN of width
    `dense_d_ff` (None: the experts' d_ff) instead of experts (first_k_dense_replace); so do
    the blocks listed in `dense_at` and, with `sparse_step` s > 1, every block i with
    (i + 1) % s != 0 (Qwen-MoE's mlp_only_layers and decoder_sparse_step).
    """

    kind: Literal["moe"] = "moe"
    expert: Annotated[Union[DenseFFN, GLUFFN], Field(discriminator="kind")] = GLUFFN()
    n_experts: int = Field(gt=0)
    top_k: int = Field(2, gt=0)
    routing: Literal["topk-softmax", "softmax-topk", "sigmoid-topk", "sigmoid-topk-norm"] = (
        "topk-softmax"
    )
    router_bias: bool = False
    selection_bias: bool = False
    n_shared_experts: int = Field(0, ge=0)
    aux_loss_coef: float = Field(0.01, ge=0)
    balance_loss: Literal["switch", "sequence"] = "switch"
    routed_scale: float = Field(1.0, gt=0)
    n_groups: int = Field(1, gt=0)
    top_k_groups: int = Field(1, gt=0)
    group_score: Literal["max", "top2-sum"] = "max"
    dense_layers: int = Field(0, ge=0)
    dense_at: tuple[Annotated[int, Field(ge=0)], ...] = ()
    sparse_step: int = Field(1, gt=0)
    dense_d_ff: int | None = Field(None, gt=0)

    def is_dense(self, layer_index: int) -> bool:
        """Whether block `layer_index` of a stack holds one dense FFN instead of experts."""
        return (
            layer_index < self.dense_layers
            or layer_index in self.dense_at
            or (layer_index + 1) % self.sparse_step != 0
        )

    @model_validator(mode="after")
    def _groups(self) -> MoEFFN:
        p, e, g = [], self.n_experts, self.n_groups
        if e % g:
            p.append(
                f"n_groups ({g}) must divide n_experts ({e}): choose n_groups in {_divisors(e)}"
            )
        elif self.top_k_groups > g:
            p.append(f"top_k_groups ({self.top_k_groups}) must be <= n_groups ({g})")
        elif g > 1 and self.group_score == "top2-sum" and e // g < 2:
            p.append(
                f"group_score 'top2-sum' needs at least 2 experts per group (n_experts {e} / "
                f"n_groups {g} = {e // g}): lower n_groups or use group_score 'max'"
            )
        elif g > 1 and self.top_k > self.top_k_groups * (e // g):  # g = 1: problems() below
            p.append(
                f"top_k ({self.top_k}) must be <= top_k_groups ({self.top_k_groups}) x experts "
                f"per group ({e // g}): the chosen groups hold no more; raise top_k_groups"
            )
        if p:
            raise ValueError("\n".join(p))
        return self

    @property
    def dense(self) -> DenseFFN | GLUFFN:
        return self.expert

    def hidden_dim(self, d_model: int) -> int:
        return self.expert.hidden_dim(d_model)

    @property
    def label(self) -> str:
        return f"moe({self.n_experts}x, top-{self.top_k})"

    @property
    def summary(self) -> str:
        e = self.expert
        out = f"MoE {self.n_experts}x{e.kind} {e.activation}, top-{self.top_k}"
        out += f", {self.routing}" if self.routing.startswith("sigmoid") else ""
        out += f" + {self.n_shared_experts} shared" if self.n_shared_experts else ""
        return out + (f", first {self.dense_layers} dense" if self.dense_layers else "")

    def problems(self, model: ModelConfig, where: str) -> list[str]:
        p = []
        if self.top_k > self.n_experts:  # with groups: _groups, which sees the groups' size
            p.append(
                f"{where}.top_k ({self.top_k}) must be <= {where}.n_experts ({self.n_experts}): "
                f"lower top_k or add experts"
            )
        return p

    def tiny_layers(self) -> int:
        """Up to the first sparse block, and the first dense one if it comes later (DeepSeek-V3's
        three dense blocks: 4; Qwen-MoE's sparse_step 2: 2)."""
        last = self.dense_layers + max(self.dense_at, default=0) + self.sparse_step + 1
        sparse = next(i for i in range(last + 1) if not self.is_dense(i))
        dense = next((i for i in range(last + 1) if self.is_dense(i)), 0)
        return max(sparse, dense) + 1

    def tiny(self, size: TinySize) -> MoEFFN:
        """At most max(4, 2·top_k) experts, so routing stays sparse; DeepSeek's dense first
        layers keep their width ratio. Grouped routing keeps choosing among groups when the
        model does (V3: 4 of 8 groups -> 3 of 4, else 2 of 4, else 1 of 2), the top-k still
        inside the groups kept; otherwise two groups, both kept."""
        e = min(self.n_experts, max(4, 2 * self.top_k))
        ch: dict[str, Any] = dict(expert=self.expert.tiny(size), n_experts=e)
        if self.dense_d_ff:
            ch["dense_d_ff"] = size.width(self.dense_d_ff)
        if self.n_groups > 1:
            choosing = [(4, 3), (4, 2), (2, 1)] if self.top_k_groups < self.n_groups else []
            for g, t in [*choosing, (2, min(self.top_k_groups, 2))]:
                per = e // g
                if not e % g and self.top_k <= t * per and (self.group_score == "max" or per > 1):
                    ch.update(n_groups=g, top_k_groups=t)
                    break
        return self.merged(**ch)


FFN = Annotated[Union[DenseFFN, GLUFFN, MoEFFN], Field(discriminator="kind")]
