"""ThinkerConfig: one typed config for every decoder the converters bring in.

Field names are Qwen's (``hidden_size``, ``num_key_value_heads``, ``head_dim``, ``num_experts``,
``decoder_sparse_step``, ``mlp_only_layers``, ``rope_parameters`` ...), so a Qwen config translates almost 1:1.
The architecture switches that Qwen hard-codes per class are explicit fields here, so that Llama, GPT-2 and the
μOmni ThinkerLM are configurations of the same model rather than other models.
"""

from __future__ import annotations

from huggingface_hub.dataclasses import strict
from transformers.configuration_utils import PreTrainedConfig
from transformers.modeling_rope_utils import RopeParameters

POSITION_EMBEDDING_TYPES = ("rope", "learned")
NORM_TYPES = ("rmsnorm", "layernorm")


@strict
class ThinkerConfig(PreTrainedConfig):
    r"""
    Configuration of a [`ThinkerModel`]. The defaults are the μOmni Thinker of ``configs/thinker_tiny.json``
    (vocab 5000, 4 layers, d_model 256, 4 heads, d_ff 1024, SwiGLU, RoPE θ=10000, context 512).

    Derived fields are filled in ``__post_init__`` only: ``num_key_value_heads`` defaults to the head count (MHA),
    ``head_dim`` to ``hidden_size // num_attention_heads``, ``moe_intermediate_size`` to ``intermediate_size``,
    ``attention_output_bias`` to ``attention_bias``, and ``mlp_layer_types`` ("dense" / "sparse" per layer) from
    the MoE fields exactly as Qwen-MoE decides them.

    ```python
    >>> from thinker import ThinkerConfig, ThinkerForCausalLM
    >>> model = ThinkerForCausalLM(ThinkerConfig(num_key_value_heads=2, qk_norm=True))
    ```
    """

    model_type = "thinker"
    keys_to_ignore_at_inference = ["past_key_values"]
    # Tensor-parallel plan: attention heads and MLP columns split across ranks, outputs all-reduced (rowwise).
    base_model_tp_plan = {
        "layers.*.self_attn.q_proj": "colwise",
        "layers.*.self_attn.k_proj": "colwise",
        "layers.*.self_attn.v_proj": "colwise",
        "layers.*.self_attn.q_norm": "replicated_with_grad_allreduce",
        "layers.*.self_attn.k_norm": "replicated_with_grad_allreduce",
        "layers.*.self_attn.o_proj": "rowwise",
        "layers.*.mlp.gate_proj": "colwise",
        "layers.*.mlp.up_proj": "colwise",
        "layers.*.mlp.down_proj": "rowwise",
        "layers.*.mlp.experts.gate_up_proj": "packed_colwise",
        "layers.*.mlp.experts.down_proj": "rowwise",
        "layers.*.mlp.experts": "moe_tp_experts",
        "layers.*.mlp.shared_expert.gate_proj": "colwise",
        "layers.*.mlp.shared_expert.up_proj": "colwise",
        "layers.*.mlp.shared_expert.down_proj": "rowwise",
    }
    base_model_pp_plan = {
        "embed_tokens": (["input_ids"], ["inputs_embeds"]),
        "layers": (["hidden_states", "attention_mask"], ["hidden_states"]),
        "norm": (["hidden_states"], ["hidden_states"]),
    }

    # --- sizes ------------------------------------------------------------------------------------------------
    vocab_size: int = 5000
    hidden_size: int = 256
    intermediate_size: int = 1024
    num_hidden_layers: int = 4
    max_position_embeddings: int = 512

    # --- attention --------------------------------------------------------------------------------------------
    num_attention_heads: int = 4
    num_key_value_heads: int | None = None  # None: as many as query heads (MHA); 1 is MQA
    head_dim: int | None = None  # None: hidden_size // num_attention_heads; Qwen3 sets it independently
    attention_bias: bool = False  # bias on q/k/v (Qwen2: True)
    attention_output_bias: bool | None = None  # bias on o_proj; None: same as attention_bias (Llama, GPT-2)
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (Qwen3)
    attention_dropout: float | int = 0.0

    # --- positions --------------------------------------------------------------------------------------------
    position_embedding_type: str = "rope"  # "rope", or "learned" absolute positions (GPT-2 / PrimeGPT)
    rope_parameters: RopeParameters | dict | None = None  # any rope_type transformers' ROPE_INIT_FUNCTIONS knows

    # --- MLP and norms ----------------------------------------------------------------------------------------
    hidden_act: str = "silu"
    mlp_gated: bool = True  # SwiGLU-style act(gate) * up; False: plain act(up) (GPT-2)
    mlp_bias: bool = False
    norm_type: str = "rmsnorm"  # "rmsnorm" (computed in fp32, as Qwen3) or "layernorm" (with bias)
    rms_norm_eps: float = 1e-6  # epsilon of every norm, whichever type

    # --- mixture of experts -----------------------------------------------------------------------------------
    num_experts: int = 0  # 0: every layer dense
    num_experts_per_tok: int = 2
    moe_intermediate_size: int | None = None
    norm_topk_prob: bool = False  # renormalise the top-k routing weights to sum to one
    decoder_sparse_step: int = 1  # layer i is sparse when (i + 1) % step == 0 ...
    mlp_only_layers: list[int] | None = None  # ... and i is not listed here
    shared_expert_intermediate_size: int = 0  # > 0: a Qwen2-MoE shared expert with its sigmoid gate
    output_router_logits: bool = False
    router_aux_loss_coef: float = 0.001

    # --- embeddings, head and the Qwen3-Omni thinker extras ---------------------------------------------------
    tie_word_embeddings: bool = False
    lm_head_bias: bool = False  # μOmni's head is a plain nn.Linear with bias
    audio_embed_size: int | None = None  # set: a Linear(audio_embed_size -> hidden) projects `audio_embeds`
    talker_head_size: int | None = None  # set: a Linear(hidden -> talker_head_size) whose logits come out too

    # --- the rest ---------------------------------------------------------------------------------------------
    mlp_layer_types: list[str] | None = None  # derived: "dense" or "sparse" per layer
    initializer_range: float = 0.02
    use_cache: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    def __post_init__(self, **kwargs):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.attention_output_bias is None:
            self.attention_output_bias = self.attention_bias
        if self.moe_intermediate_size is None:
            self.moe_intermediate_size = self.intermediate_size
        if self.mlp_only_layers is None:
            self.mlp_only_layers = []
        if self.mlp_layer_types is None:
            self.mlp_layer_types = [
                "sparse"
                if self.num_experts > 0 and i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0
                else "dense"
                for i in range(self.num_hidden_layers)
            ]
        if self.position_embedding_type == "rope" and self.rope_parameters is None and "rope_theta" not in kwargs:
            kwargs["rope_theta"] = 10000.0
        super().__post_init__(**kwargs)
        if self.position_embedding_type == "learned":
            self.rope_parameters = None

    def validate_architecture(self):
        """Checks the switches that have a closed set of values (called by ``validate``)."""
        if self.position_embedding_type not in POSITION_EMBEDDING_TYPES:
            raise ValueError(
                f"position_embedding_type={self.position_embedding_type!r}; expected one of {POSITION_EMBEDDING_TYPES}"
            )
        if self.norm_type not in NORM_TYPES:
            raise ValueError(f"norm_type={self.norm_type!r}; expected one of {NORM_TYPES}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if len(self.mlp_layer_types) != self.num_hidden_layers or set(self.mlp_layer_types) - {"dense", "sparse"}:
            raise ValueError(
                f"mlp_layer_types must list 'dense' or 'sparse' for each of {self.num_hidden_layers} layers"
            )
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} must lie in 1..{self.num_experts}")

    @property
    def num_key_value_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads


__all__ = ["ThinkerConfig"]
