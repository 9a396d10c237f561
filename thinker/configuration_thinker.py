# Copyright 2026 The Thinker authors.
# SPDX-License-Identifier: Apache-2.0
"""ThinkerConfig: one typed config for every decoder the converters bring in.

Field names are Qwen's (``hidden_size``, ``num_key_value_heads``, ``head_dim``, ``num_experts``,
``decoder_sparse_step``, ``mlp_only_layers``, ``rope_parameters`` ...), so a Qwen config translates almost 1:1.
The architecture switches that Qwen hard-codes per class are explicit fields here, so that Llama, GPT-2 and the
μOmni ThinkerLM are configurations of the same model rather than other models.
"""

# No ``from __future__ import annotations`` here: huggingface_hub's ``@strict`` checks each field's value against its
# annotation, as it does transformers' own configs', and skips annotations that are strings, which that import makes
# of all of them (a switch given as "no" then passed for true).
from huggingface_hub.dataclasses import strict
from transformers.configuration_utils import PreTrainedConfig
from transformers.modeling_rope_utils import RopeParameters

POSITION_EMBEDDING_TYPES = ("rope", "learned")
NORM_TYPES = ("rmsnorm", "layernorm")
# Token mixers, per layer (transformers' names: its caches and mask builders dispatch on them). "indexed_attention"
# is full attention restricted, per query, to the key blocks a QSA indexer picks (Qwen3.8's qwen4_exp).
LAYER_TYPES = ("full_attention", "linear_attention", "indexed_attention")
GATE_ACTIVATIONS = ("silu", "sigmoid")
QSA_FIELDS = ("indexer_n_heads", "indexer_head_dim", "indexer_budget", "indexer_compress_ratio")
MLP_LAYER_TYPES = ("dense", "sparse")

# Parallel plans, one table per kind of module; ``ThinkerConfig.base_model_tp_plan`` / ``base_model_ep_plan`` keep
# the tables of the modules that this config's model has, so that every entry names some of its parameters.
# Attention heads and MLP columns split across ranks, outputs all-reduced (rowwise), as Qwen3 / Qwen2-MoE plan them.
_FULL_ATTENTION_TP_PLAN = {
    "layers.*.self_attn.q_proj": "colwise",
    "layers.*.self_attn.k_proj": "colwise",
    "layers.*.self_attn.v_proj": "colwise",
    "layers.*.self_attn.o_proj": "rowwise",
}
_QK_NORM_TP_PLAN = {
    "layers.*.self_attn.q_norm": "replicated_with_grad_allreduce",
    "layers.*.self_attn.k_norm": "replicated_with_grad_allreduce",
}
# Gated DeltaNet, as Qwen3.5 plans it: each rank computes every head and gathers the projections' outputs.
_LINEAR_ATTENTION_TP_PLAN = {
    "layers.*.linear_attn.in_proj_qkv": "colwise_gather_output",
    "layers.*.linear_attn.in_proj_z": "colwise_gather_output",
    "layers.*.linear_attn.in_proj_b": "colwise_gather_output",
    "layers.*.linear_attn.in_proj_a": "colwise_gather_output",
    "layers.*.linear_attn.out_proj": "colwise_gather_output",
}
_EXPERTS_TP_PLAN = {
    "layers.*.mlp.experts.gate_up_proj": "packed_colwise",
    "layers.*.mlp.experts.down_proj": "rowwise",
    "layers.*.mlp.experts": "moe_tp_experts",
}
# Qwen4-Exp's plan for its own modules: the indexer gathers its projection; the mixers' low-rank input projection is
# split along its input; the n-gram tables (tens of GB each at full size) are split along their width.
_INDEXER_TP_PLAN = {"layers.*.self_attn.indexer.index_qk_proj": "colwise_gather_output"}
_HYPER_CONNECTIONS_TP_PLAN = {
    "layers.*.attn_hyper_connection.input_mix_weight_down": "rowwise_split_input",
    "layers.*.mlp_hyper_connection.input_mix_weight_down": "rowwise_split_input",
    "hyper_connection_mixer.input_mix_weight_down": "rowwise_split_input",
}
_PLE_TP_PLAN = {"layers.*.ple.ple_embedding.ngram_embedding": "embedding_colwise"}
# Expert parallelism (Qwen3-MoE's plan): whole experts per rank, tokens dispatched to them.
_EXPERTS_EP_PLAN = {
    "layers.*.mlp.experts.gate_up_proj": "grouped_gemm",
    "layers.*.mlp.experts.down_proj": "grouped_gemm",
    "layers.*.mlp.experts": "ep_dispatch_experts",
}


def _mlp_tp_plan(prefix: str, gated: bool) -> dict[str, str]:
    plan = {f"{prefix}.up_proj": "colwise", f"{prefix}.down_proj": "rowwise"}
    if gated:
        plan[f"{prefix}.gate_proj"] = "colwise"
    return plan


@strict
class ThinkerConfig(PreTrainedConfig):
    r"""
    Configuration of a [`ThinkerModel`]. The defaults are the μOmni Thinker of ``configs/thinker_tiny.json``
    (vocab 5000, 4 layers, d_model 256, 4 heads, d_ff 1024, SwiGLU, RoPE θ=10000, context 512), but for its head's
    bias: ``lm_head_bias`` defaults to False, as every other family's head has none.

    Defaults filled in ``__post_init__``: ``num_key_value_heads`` defaults to the head count (MHA), ``head_dim`` to
    ``hidden_size // num_attention_heads``, ``moe_intermediate_size`` to ``intermediate_size``,
    ``attention_output_bias`` to ``attention_bias``, and ``layer_types`` (the token mixer per layer) to all
    ``"full_attention"`` when not given.

    Derived on every read, so that they follow edits of the fields they come from: ``mlp_layer_types`` ("dense" /
    "sparse" per layer, from ``num_experts``, ``decoder_sparse_step`` and ``mlp_only_layers`` exactly as Qwen-MoE
    decides them) and the parallel plans ``base_model_tp_plan`` / ``base_model_ep_plan`` (only the entries whose
    modules this config's model has).

    ```python
    >>> from thinker import ThinkerConfig, ThinkerForCausalLM
    >>> model = ThinkerForCausalLM(ThinkerConfig(num_key_value_heads=2, qk_norm=True))
    ```
    """

    model_type = "thinker"
    keys_to_ignore_at_inference = ["cache", "past_key_values"]  # the name since transformers 5.24, and before
    base_model_pp_plan = {
        "embed_tokens": (["input_ids"], ["inputs_embeds"]),
        "layers": (["hidden_states", "attention_mask"], ["hidden_states"]),
        "norm": (["hidden_states"], ["hidden_states"]),
    }
    # Multimodal RoPE keys (Qwen3.5, Qwen3-Omni) are read by the rotary embedding, not by transformers' validators.
    ignore_keys_at_rope_validation = {"mrope_section", "mrope_interleaved", "interleaved"}

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
    attention_output_gate: bool = False  # q_proj also yields a per-head gate; output * sigmoid(gate) (Qwen3.5)
    attention_dropout: float | int | None = 0.0  # None (Llama's and Qwen2-VL's configs allow it): 0.0

    # --- positions --------------------------------------------------------------------------------------------
    position_embedding_type: str = "rope"  # "rope", or "learned" absolute positions (GPT-2 / PrimeGPT)
    # Any rope_type transformers' ROPE_INIT_FUNCTIONS knows, plus "partial_rotary_factor" (Qwen3.5: 0.25) and
    # multimodal RoPE: "mrope_section" [t, h, w] frequencies, which (3, B, T) position_ids select, interleaved
    # (Qwen3-VL, Qwen3.5, Qwen3-Omni) or, with "mrope_interleaved": False, in contiguous sections (Qwen2-VL,
    # Qwen2.5-VL, Qwen2.5-Omni).
    rope_parameters: RopeParameters | dict | None = None

    # --- MLP and norms ----------------------------------------------------------------------------------------
    hidden_act: str = "silu"
    mlp_gated: bool = True  # SwiGLU-style act(gate) * up; False: plain act(up) (GPT-2)
    mlp_bias: bool = False
    norm_type: str = "rmsnorm"  # "rmsnorm" (computed in fp32, as Qwen3) or "layernorm" (with bias)
    norm_zero_centered: bool = False  # RMSNorm weights stored as offsets from one: x * (1 + w) (Qwen3.5, Qwen3-Next)
    rms_norm_eps: float = 1e-6  # epsilon of every norm, whichever type

    # --- hybrid token mixers: Gated DeltaNet linear attention (Qwen3.5, Qwen3-Next) ---------------------------
    # Per layer "full_attention" or "linear_attention"; None: every layer full attention. It is the one source of
    # truth (no other field is derived into it), so editing it is all it takes to change a layer's mixer; its length
    # follows num_hidden_layers (a model refuses to build from a list of another length).
    layer_types: list[str] | None = None
    linear_conv_kernel_dim: int = 4  # depthwise causal conv over q, k, v before the delta rule
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32  # a multiple of linear_num_key_heads: each key head serves several
    output_gate_type: str = "silu"  # the activation of the gate on Gated DeltaNet's output norm: silu or sigmoid

    # --- Qwen3.8 (qwen4_exp): hyper-connections, a sparse-attention indexer, hashed n-gram embeddings -----------
    # hc_count > 1: the residual stream is hc_count streams of hidden_size; each sub-layer reads a learned mix of
    # them (in place of its input norm) and writes its output back into each with a learned weight; a last mix
    # replaces the final norm. 1: the plain pre-norm residual.
    hc_count: int = 1
    hc_lowrank: int = 0  # rank of the mixers' input projection (down to it, then up to hc_count * hidden_size)
    # "indexed_attention" layers: an indexer scores blocks of indexer_compress_ratio visible keys (mean-pooled) with
    # indexer_n_heads query heads of indexer_head_dim, and each query attends to its best indexer_budget tokens'
    # worth of blocks plus the unfinished block at its end.
    indexer_n_heads: int | None = None
    indexer_head_dim: int | None = None
    indexer_budget: int | None = None
    indexer_compress_ratio: int | None = None
    # Per-layer embeddings (PLE) on the linear-attention layers listed (one-indexed, as Qwen numbers them): token
    # 2..ngram_size-grams hashed into heads_per_ngram tables each, gated into every stream, plus a dilated conv.
    ple_layer_ids: list[int] | None = None
    ple_embed_dim: int | None = None  # None: hidden_size
    ple_conv_kernel_size: int = 4
    ngram_size: int = 3
    heads_per_ngram: int = 8
    ngram_vocab_size_base: int = 20_000_000  # each hash table's size is a distinct prime above this
    make_ngram_vocab_size_divisible_by: int = 128
    ngram_seed: int = 1234  # Qwen's ``seed``: the hash multipliers derive from it
    # The vocabulary size the multipliers were drawn for (so that id x multiplier fits int64): Qwen4-Exp draws them
    # from vocab_size as the model is built, and a checkpoint keeps them through a later resize of its embeddings.
    # None: vocab_size, fixed to it as the config is made, so that a resized Thinker keeps its hash too.
    ngram_hash_vocab_size: int | None = None
    split_ngram_parts: int = 1  # how many pieces a checkpoint stores each n-gram table in (the way back's layout)

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
    # Qwen3-VL / Qwen3-Omni: how many first decoder layers the vision tower's DeepStack features follow (its
    # deepstack_visual_indexes); the PyTorch model takes as many as given, the ONNX embeds graph this many
    deepstack_layers: int = 0

    # --- the rest ---------------------------------------------------------------------------------------------
    initializer_range: float = 0.02
    use_cache: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    def __post_init__(self, **kwargs):
        self.refuse_unusable_divisors()
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.attention_output_bias is None:
            self.attention_output_bias = self.attention_bias
        if self.attention_dropout is None:
            self.attention_dropout = 0.0
        if self.moe_intermediate_size is None:
            self.moe_intermediate_size = self.intermediate_size
        if self.mlp_only_layers is None:
            self.mlp_only_layers = []
        if self.layer_types is None:
            self.layer_types = ["full_attention"] * self.num_hidden_layers
        self.ple_layer_ids = sorted(set(self.ple_layer_ids or ()))
        if self.ple_embed_dim is None:
            self.ple_embed_dim = self.hidden_size
        if self.ple_layer_ids and self.ngram_hash_vocab_size is None:
            self.ngram_hash_vocab_size = self.vocab_size
        # config.json files written before mlp_layer_types was derived carry it: fold it into the MoE fields.
        if (mlp_layer_types := kwargs.pop("mlp_layer_types", None)) is not None:
            self.mlp_layer_types = mlp_layer_types
        if self.position_embedding_type == "rope" and self.rope_parameters is None and "rope_theta" not in kwargs:
            kwargs["rope_theta"] = 10000.0
        super().__post_init__(**kwargs)
        if self.position_embedding_type == "learned":
            self.rope_parameters = None

    def refuse_unusable_divisors(self) -> None:
        """The head counts and the sparse step the defaults and the checks divide by, refused by name unless whole
        numbers of 1 or more (a ZeroDivisionError or TypeError named no key); each where it is used: the sparse step
        with experts, the linear attention's key heads with linear-attention layers."""
        divisors = {"num_attention_heads": True, "num_key_value_heads": self.num_key_value_heads is not None}
        divisors |= {"decoder_sparse_step": self.num_experts != 0}
        divisors |= {"linear_num_key_heads": "linear_attention" in (self.layer_types or ())}
        for name, used in divisors.items():
            if used and not is_whole(value := getattr(self, name), 1):
                raise ValueError(f"{name}={value!r} must be a whole number, 1 or more")

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
        if self.num_experts < 0:
            raise ValueError(f"num_experts={self.num_experts} must be 0 (every layer dense) or more")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} must lie in 1..{self.num_experts}")
        if len(self.layer_types) != self.num_hidden_layers or set(self.layer_types) - set(LAYER_TYPES):
            raise ValueError(
                f"layer_types must list one of {LAYER_TYPES} for each of {self.num_hidden_layers} layers; "
                f"got {self.layer_types}"
            )
        if "linear_attention" in self.layer_types and self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(
                f"linear_num_value_heads={self.linear_num_value_heads} is not a multiple of "
                f"linear_num_key_heads={self.linear_num_key_heads}"
            )
        if self.output_gate_type not in GATE_ACTIVATIONS:
            raise ValueError(f"output_gate_type={self.output_gate_type!r}; expected one of {GATE_ACTIVATIONS}")
        self.validate_qwen4_exp()
        if self.norm_zero_centered and self.norm_type != "rmsnorm":
            raise ValueError("norm_zero_centered applies to RMSNorm weights; it needs norm_type='rmsnorm'")
        if not 0 <= self.deepstack_layers <= self.num_hidden_layers:
            raise ValueError(
                f"deepstack_layers={self.deepstack_layers} must lie in [0, num_hidden_layers={self.num_hidden_layers}]"
            )
        mrope_section = (self.rope_parameters or {}).get("mrope_section")
        for key in ("mrope_interleaved", "interleaved"):
            value = (self.rope_parameters or {}).get(key)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"rope_parameters['{key}']={value!r}; expected true or false")
        if mrope_section is not None:
            # transformers' RoPE takes a frequency per even channel of the rotary part: an odd part of 5 has 3
            rotary_pairs = (int(self.head_dim * self.rope_parameters.get("partial_rotary_factor", 1.0)) + 1) // 2
            if len(mrope_section) != 3 or sum(mrope_section) != rotary_pairs:
                raise ValueError(
                    f"rope_parameters['mrope_section']={mrope_section} must give [t, h, w] frequency counts summing to "
                    f"the {rotary_pairs} rotary frequencies of a head"
                )

    def validate_qwen4_exp(self) -> None:
        """Hyper-connections, the indexer and PLE: the sizes each needs, checked as Qwen4ExpTextConfig checks them."""
        if self.hc_count < 1 or (self.hc_count > 1 and self.hc_lowrank < 1):
            raise ValueError(
                f"hc_count={self.hc_count}, hc_lowrank={self.hc_lowrank}: hc_count is 1 (no hyper-connections) or "
                "more, with hc_lowrank >= 1"
            )
        if (self.hc_count > 1 or self.ple_layer_ids) and self.norm_type != "rmsnorm":
            raise ValueError("hyper-connections and PLE normalise with RMSNorm; they need norm_type='rmsnorm'")
        if self.has_indexed_attention:
            wrong = [f"{name}={getattr(self, name)!r}" for name in QSA_FIELDS if not is_whole(getattr(self, name), 1)]
            if wrong:
                raise ValueError(f"indexed_attention layers need {', '.join(wrong)} as positive integers")
            if self.indexer_budget % self.indexer_compress_ratio:
                raise ValueError(
                    f"indexer_budget={self.indexer_budget} is not a multiple of "
                    f"indexer_compress_ratio={self.indexer_compress_ratio}"
                )
            rotary = int(self.head_dim * (self.rope_parameters or {}).get("partial_rotary_factor", 1.0))
            if rotary > self.indexer_head_dim:
                raise ValueError(
                    f"the indexer's heads ({self.indexer_head_dim}) are narrower than the rotary part of the "
                    f"attention's ({rotary}), whose RoPE they take"
                )
        if self.ple_layer_ids:
            heads = (self.ngram_size - 1) * self.heads_per_ngram
            if heads < 1 or self.ple_embed_dim % heads:
                raise ValueError(
                    f"ple_embed_dim={self.ple_embed_dim} must split into the {heads} n-gram heads "
                    "((ngram_size - 1) x heads_per_ngram)"
                )
            wrong = [i for i in self.ple_layer_ids if not 1 <= i <= self.num_hidden_layers]
            wrong = wrong or [i for i in self.ple_layer_ids if self.layer_types[i - 1] != "linear_attention"]
            if wrong:
                raise ValueError(
                    f"ple_layer_ids {wrong}: PLE layers are linear-attention layers, numbered from 1 to "
                    f"num_hidden_layers={self.num_hidden_layers}"
                )
            if self.ngram_eos_token_id is None:
                raise ValueError("PLE layers need eos_token_id: the n-gram hashes restart after it")

    @property
    def ngram_eos_token_id(self) -> int | None:
        """The token that ends an n-gram context (the first eos id, as Qwen4-Exp takes it)."""
        eos = self.eos_token_id
        return (eos[0] if eos else None) if isinstance(eos, list) else eos

    @property
    def qwen4_exp_features(self) -> list[str]:
        """Which of Qwen3.8's (qwen4_exp) additions this model has, by name (whose state onnxruntime-genai has no
        model type for: the ONNX export runs under onnxruntime alone)."""
        features = [
            ("hyper-connections (hc_count > 1)", self.hc_count > 1),
            ("indexed_attention layers (the QSA indexer)", self.has_indexed_attention),
            ("per-layer n-gram embeddings (ple_layer_ids)", bool(self.ple_layer_ids)),
        ]
        return [name for name, present in features if present]

    @property
    def number_of_conv_states(self) -> int:
        """Conv states per linear-attention cache layer, which transformers' caches read: with PLE, a PLE layer also
        keeps its conv's window and its last n-gram context there (Qwen4-Exp's slots 1 and 2)."""
        return 3 if self.ple_layer_ids else 1

    @property
    def mlp_layer_types(self) -> list[str]:
        """The MLP kind of each layer, "dense" or "sparse": sparse where Qwen-MoE puts experts (``num_experts`` > 0,
        ``(i + 1)`` a multiple of ``decoder_sparse_step``, ``i`` not in ``mlp_only_layers``)."""
        only_dense = set(self.mlp_only_layers or ())
        return [
            "sparse" if self.num_experts > 0 and i not in only_dense and (i + 1) % self.decoder_sparse_step == 0
            else "dense"
            for i in range(self.num_hidden_layers)
        ]  # fmt: skip

    @mlp_layer_types.setter
    def mlp_layer_types(self, types: list[str]) -> None:
        # Kept as the MoE fields that produce it (not as a list of its own), so that they stay the one source.
        types = list(types)
        if len(types) != self.num_hidden_layers or set(types) - set(MLP_LAYER_TYPES):
            raise ValueError(
                f"mlp_layer_types must list one of {MLP_LAYER_TYPES} for each of {self.num_hidden_layers} layers; "
                f"got {types}"
            )
        if types == self.mlp_layer_types:
            return
        if "sparse" in types and self.num_experts == 0:
            raise ValueError(f"mlp_layer_types {types} has sparse layers but num_experts is 0")
        self.decoder_sparse_step = 1
        self.mlp_only_layers = [i for i, kind in enumerate(types) if kind == "dense"]

    @property
    def base_model_tp_plan(self) -> dict[str, str]:
        """The tensor-parallel plan of the modules this config's layers have (transformers reads it when a model is
        built, so the plan follows the config as it is then)."""
        plan = {}
        if {"full_attention", "indexed_attention"} & set(self.layer_types):
            plan |= _FULL_ATTENTION_TP_PLAN | (_QK_NORM_TP_PLAN if self.qk_norm else {})
        if self.has_indexed_attention:
            plan |= _INDEXER_TP_PLAN
        if self.hc_count > 1:
            plan |= _HYPER_CONNECTIONS_TP_PLAN
        if self.ple_layer_ids:
            plan |= _PLE_TP_PLAN
        if self.has_linear_attention:
            plan |= _LINEAR_ATTENTION_TP_PLAN
        mlp_types = self.mlp_layer_types
        if "dense" in mlp_types:
            plan |= _mlp_tp_plan("layers.*.mlp", self.mlp_gated)
        if "sparse" in mlp_types:
            plan |= _EXPERTS_TP_PLAN
            if self.shared_expert_intermediate_size:
                plan |= _mlp_tp_plan("layers.*.mlp.shared_expert", self.mlp_gated)
        return plan

    @property
    def base_model_ep_plan(self) -> dict[str, str] | None:
        """The expert-parallel plan: the experts of the sparse layers, whole experts per rank; None without any."""
        return dict(_EXPERTS_EP_PLAN) if "sparse" in self.mlp_layer_types else None

    @property
    def num_key_value_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def has_linear_attention(self) -> bool:
        return "linear_attention" in self.layer_types

    @property
    def has_indexed_attention(self) -> bool:
        return "indexed_attention" in self.layer_types


__all__ = ["ThinkerConfig"]


def is_whole(value, least: int) -> bool:
    """Whether a config value is a whole number of at least ``least`` (JSON's true is a Python int, and no size)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def mrope_interleaved(rope_parameters: dict | None) -> bool:
    """Whether a multimodal RoPE interleaves its sections (the default) or lays them out one after another."""
    rope = rope_parameters or {}
    return bool(rope.get("mrope_interleaved", rope.get("interleaved", True)))
