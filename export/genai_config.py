"""``genai_config.json``: what onnxruntime-genai needs to run the exported decoder, and nothing to edit by hand.

onnxruntime-genai picks its model class from ``model.type``; "qwen2", "qwen3" and "llama" all select its generic
decoder-only model, which reads the IO names from the ``inputs``/``outputs`` sections below, so our contract
names are declared there rather than assumed.

Hybrid models (docs/hybrid-export.md, measured on onnxruntime-genai 0.18): the linear-attention layers' state names
are written out (``past_conv_names`` ...; onnxruntime-genai's defaults are the same names, but nothing rests on a
default), and it finds those layers by matching the session's inputs against them. The model type decides the
positions it feeds: "qwen3_5_text" / "qwen3_5_moe_text" (the hybrid types 0.18 runs from a decoder folder) feed the
(3, B, T) positions a multimodal-RoPE graph declares; every graph with (B, T) positions (Qwen3-Next, which 0.18 does
not know as "qwen3_next", and Qwen3.5's onnxruntime-genai graph, which takes (B, T) positions whatever model.onnx
takes: export/genai_graph.py) gets "qwen3". onnxruntime-genai pads a batch on the right; the graphs leave the
linear-attention states untouched at pads, so rows of unequal length are right for hybrid models with (B, T) positions
as for dense ones. With (3, B, T) positions they would not be: that position code sets every mask slot to 1 from the
first decode step, unmasking the pads (docs/hybrid-export.md 1.3, 5.2), which is why no export names those types for
the graph genai runs now.

``past_present_share_buffer``: the plain graph grows the KV cache by concatenation (past and present are distinct
buffers), so it is false there. The fused graph's GroupQueryAttention also takes one buffer of the whole context
bound as both past and present, writing each step's keys and values in place (its cache slots follow the
attention mask, so left padding keeps working); onnxruntime-genai then skips the per-step copy of the cache, which
is most of what batch decoding spends beyond the weights. The graph's IO contract is unchanged: a caller that
concatenates (OnnxDecoder) feeds a past of P slots and gets P + T back, as before.
"""

from __future__ import annotations

from pathlib import Path

from thinker.configuration_thinker import ThinkerConfig
from thinker_common.errors import ThinkerError
from thinker_common.side_files import read_json

from .decoder_graph import position_form
from .names import MODEL_FILE, export_context


def genai_model_type(config: ThinkerConfig, positions: str) -> str:
    # Only the decoder-only family matters to the runtime; the name follows the nearest Qwen release. A graph with
    # (3, B, T) positions needs one of the types whose position code feeds them; every other graph, Qwen3.5 with
    # --positions text included, takes the generic decoder's (B, T) positions.
    if positions == "multimodal":
        return "qwen3_5_moe_text" if config.num_experts else "qwen3_5_text"
    return "qwen3" if config.qk_norm else "qwen2"


def logits_note(logits: str) -> str | None:
    """What the export tells a user of ``--logits last`` about the runtimes that read it."""
    if logits != "last":
        return None
    return (
        "logits are [batch, 1, vocab] (each row's last kept position): onnxruntime-genai reads them from 0.12.2 on "
        "and older releases fail on them; export with --logits all (the default) to score every position of a text"
    )


# onnxruntime-genai 0.18's multimodal position code (the qwen3_5 types) scans each prompt for these ids and wants image
# grids for the spans they open. The graph onnxruntime-genai runs takes token ids only (images reach a model as
# embeddings, through --inputs-embeds' model.embeds.onnx, which genai does not run), so no token opens a span: -1
# matches none. Left unset they default to 0, which is also our
# pad id, and a left-padded batch then fails with "Not enough image_grid_thw data for image tokens" (measured).
NO_VISION_TOKENS = {"image_token_id": -1, "video_token_id": -1, "vision_start_token_id": -1}

# onnxruntime-genai's keys for the linear-attention states, and our names (DESIGN.md), which are also its defaults.
STATE_NAMES = {
    "inputs": {
        "past_conv_names": "past_key_values.%d.conv_state",
        "past_recurrent_names": "past_key_values.%d.recurrent_state",
    },
    "outputs": {"present_conv_names": "present.%d.conv_state", "present_recurrent_names": "present.%d.recurrent_state"},
}


def _is_token(value, vocab_size: int) -> bool:
    """Whether a config's id names a token of the vocabulary (JSON's true is a Python int, and no token)."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < vocab_size


def special_token_ids(config: ThinkerConfig, generation_config: dict | None) -> tuple[int, list[int], int]:
    """bos, eos (a list: chat models end turns with more than one) and pad ids, generation_config.json first, each
    a token of the vocabulary.

    onnxruntime-genai needs an eos it can index its logits with: 0.18 refuses one outside [0, vocab_size) (a
    ``-1`` for "none" included), and every version since 0.8 stops at the pad id when the key is absent. A model
    whose configs name no eos therefore gets its pad id written as eos, explicitly (the same stop every version
    makes of a missing key; ``no_eos_note`` says so in the export report)."""
    generation_config = generation_config or {}

    def pick(key: str):
        value = generation_config.get(key)
        return value if value is not None else getattr(config, key, None)

    def token(value) -> int | None:
        return value if _is_token(value, config.vocab_size) else None

    eos = pick("eos_token_id")
    eos_ids = [i for i in (eos if isinstance(eos, list | tuple) else [eos]) if token(i) is not None]
    bos, pad = token(pick("bos_token_id")), token(pick("pad_token_id"))
    if pad is None:
        pad = eos_ids[0] if eos_ids else bos if bos is not None else 0
    if bos is None:
        bos = eos_ids[0] if eos_ids else pad
    return bos, eos_ids or [pad], pad


def no_eos_note(config: ThinkerConfig, generation_config: dict | None) -> str | None:
    """What the export report says when ``special_token_ids`` had to stand the pad id in for a missing eos."""
    eos = (generation_config or {}).get("eos_token_id")
    eos = eos if eos is not None else config.eos_token_id
    listed = eos if isinstance(eos, list | tuple) else [eos]
    if any(_is_token(i, config.vocab_size) for i in listed):
        return None
    _, (stop,), _ = special_token_ids(config, generation_config)
    return (
        f"the model's configs name no eos_token_id within its vocabulary ({eos!r}); genai_config.json stops at "
        f"token {stop} (its pad id), since onnxruntime-genai needs one: set eos_token_id in config.json or "
        "generation_config.json and export again if the model has an end-of-text token"
    )


# What transformers' generate() decodes a folder with unless told otherwise: generation_config.json's values, else
# these, GenerationConfig's defaults (tests/export/test_genai_config.py holds them to transformers'). Every key is
# written, so nothing rests on onnxruntime-genai's own defaults. Greedy where the folder says nothing.
SEARCH_DEFAULTS = {
    "do_sample": False,
    "temperature": 1.0,
    "top_k": 50,
    "top_p": 1.0,
    "repetition_penalty": 1.0,
    "no_repeat_ngram_size": 0,
}


def _number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


SAMPLING_ONLY = ("temperature", "top_k", "top_p")  # what greedy search leaves unread

SEARCH_VALID = {
    "do_sample": lambda v: isinstance(v, bool),
    "temperature": lambda v: _number(v) and v > 0,
    "top_k": _count,
    "top_p": lambda v: _number(v) and 0 < v <= 1,
    "repetition_penalty": lambda v: _number(v) and v > 0,
    "no_repeat_ngram_size": _count,
}


def check_search(path: Path, config: ThinkerConfig, where: str = "the Thinker folder") -> None:
    """The generation_config.json at ``path`` as genai_config.json will take its search keys (``search_options``,
    ``search_max_length``), refused by key before any work: a Thinker folder's, or (``where``: "the source") that of
    a source the export converts first, before it is converted, so that the message names a file the user has.
    Nothing to check where no genai_config.json is written (Qwen3.8's states are more than genai carries)."""
    if config.qwen4_exp_features:
        return
    generation = read_json(path)
    search_options(generation, path, where)
    search_max_length(
        generation, export_context(config.max_position_embeddings, config.rope_parameters)[0], path, where
    )


def search_options(
    generation_config: dict | None, path: object = "generation_config.json", where: str = "the Thinker folder"
) -> dict:
    """genai_config.json's sampling keys from the folder's generation_config.json, as transformers' generate() uses
    them (a Qwen3 release samples at temperature 0.6, top_p 0.95, top_k 20, as its card asks); a value
    onnxruntime-genai cannot take is refused by key, where generate() reads it (sampling keys when it samples)."""
    given = generation_config if isinstance(generation_config, dict) else {}
    options = {key: default if given.get(key) is None else given[key] for key, default in SEARCH_DEFAULTS.items()}
    if options["do_sample"] is False:
        # generate() builds no sampling warper for greedy search, so it runs a file with temperature 0 or top_k -1
        # there (with a warning that they "may be ignored"); onnxruntime-genai gets the defaults in their place.
        # Valid ones stay: a caller who turns sampling on (set_search_options) samples as generate() would.
        options |= {key: SEARCH_DEFAULTS[key] for key in SAMPLING_ONLY if not SEARCH_VALID[key](options[key])}
    for key, value in options.items():
        if not SEARCH_VALID[key](value):
            raise ThinkerError(
                f"{path}: {key}={value!r} is not a value generate() takes (do_sample true or false; "
                "temperature and repetition_penalty above 0; top_p in (0, 1]; top_k and no_repeat_ngram_size whole "
                f"numbers, 0 or more); correct it in {where} and export again"
            )
    return options


def search_max_length(
    generation_config: dict | None,
    context: int,
    path: object = "generation_config.json",
    where: str = "the Thinker folder",
) -> int:
    """The total length onnxruntime-genai stops at (and sizes its KV buffer for) by default: generation_config.json's
    ``max_length`` where it names one, as ``generate()`` stops there (Llama 3's releases: 4096 of 8192), within the
    context; else the context. A ``max_new_tokens`` beside it is what ``generate()`` follows instead, a length past
    each prompt, which genai_config.json cannot say: the context then. A caller's ``set_search_options(max_length=N)``
    takes any length up to the context either way."""
    given = generation_config if isinstance(generation_config, dict) else {}
    length = given.get("max_length")
    if length is None or given.get("max_new_tokens") is not None:
        return context
    if not _count(length) or length == 0:
        raise ThinkerError(
            f"{path}: max_length={length!r} is not a length generate() takes (a whole number above 0); correct it "
            f"in {where} (or remove it) and export again"
        )
    return min(length, context)


def make_genai_config(
    config: ThinkerConfig,
    generation_config: dict | None,
    threads: int | None = None,
    share_buffer: bool = False,
    positions: str | None = None,
    graph: str = MODEL_FILE,
    graph_positions: bool = True,
) -> dict:
    """``share_buffer``: the graph updates one KV buffer in place when bound as past and present (fused graphs);
    ``positions``: the graph's position_ids form, "multimodal" (3, B, T) or "text" (B, T); None for the model's own
    (``position_form``); ``graph``: the file onnxruntime-genai runs (``model.genai.onnx`` where the export wrote
    one: export/genai_graph.py), ``graph_positions``: whether that graph takes position_ids."""
    bos, eos, pad = special_token_ids(config, generation_config)
    layers = config.num_hidden_layers
    context = export_context(config.max_position_embeddings, config.rope_parameters)[0]
    genai = {
        "model": {
            "type": genai_model_type(config, position_form(config, positions)),
            "bos_token_id": bos,
            "eos_token_id": eos if len(eos) > 1 else eos[0],
            "pad_token_id": pad,
            "context_length": context,
            "vocab_size": config.vocab_size,
            "decoder": {
                "filename": graph,
                "head_size": config.head_dim,
                "hidden_size": config.hidden_size,
                "num_attention_heads": config.num_attention_heads,
                "num_key_value_heads": config.num_key_value_heads,
                "num_hidden_layers": layers,
                "session_options": {
                    "log_id": "onnxruntime-genai",
                    # Without this key onnxruntime-genai runs the session on one thread. 0 is onnxruntime's own
                    # default, one thread per physical core of the machine that runs the model (not the one
                    # that exported it); --threads writes a fixed count instead.
                    "intra_op_num_threads": threads or 0,
                    "provider_options": [],
                },
                "inputs": {
                    "input_ids": "input_ids",
                    "attention_mask": "attention_mask",
                    "position_ids": "position_ids",
                    "past_key_names": "past_key_values.%d.key",
                    "past_value_names": "past_key_values.%d.value",
                },
                "outputs": {
                    "logits": "logits",
                    "present_key_names": "present.%d.key",
                    "present_value_names": "present.%d.value",
                },
            },
        },
        "search": {
            **search_options(generation_config),
            "num_beams": 1,
            "num_return_sequences": 1,
            "length_penalty": 1.0,
            "diversity_penalty": 0.0,
            "min_length": 0,
            "max_length": search_max_length(generation_config, context),
            "early_stopping": True,
            "past_present_share_buffer": share_buffer,
        },
    }
    if not graph_positions:
        del genai["model"]["decoder"]["inputs"]["position_ids"]
    if genai["model"]["type"].startswith("qwen3_5"):
        genai["model"].update(NO_VISION_TOKENS)
    if config.has_linear_attention:
        for section, names in STATE_NAMES.items():
            genai["model"]["decoder"][section].update(names)
    return genai
