"""``--verify``'s check of ``genai_config.json`` against the graph it names: what no prompt through onnxruntime reaches.

onnxruntime-genai reads the file and never checks it against the graph: a wrong input name fails only at its first
run, a ``context_length`` past the graph's RoPE table runs positions off it, and ``past_present_share_buffer`` on a
graph whose cache cannot be written in place corrupts the cache as it decodes. So the file is read back as onnxruntime-
genai reads it and each of these held to the graph and the model's config (a QA sweep's edited file passed every
other check). The eos and search values are the folder's own (export/genai_config.py), written once: not re-derived.
"""

from __future__ import annotations

from pathlib import Path

import onnx

from thinker_common.side_files import read_json

from .names import GENAI_CONFIG_FILE
from .runtime import shared_kv_names

# Each state onnxruntime-genai feeds back, by its keys in model.decoder: the input it reads the past from and the
# output it takes the present from, which must be the graph's present of that same past (``OnnxDecoder`` pairs them
# by name, past_key_values.N.X -> present.N.X, as the verify's own decoding runs them). Two present names swapped
# (keys for values) name graph outputs all the same, and genai would feed a layer's values back as its keys.
STATE_PAIRS = {
    "past_key_names": "present_key_names",
    "past_value_names": "present_value_names",
    "past_conv_names": "present_conv_names",
    "past_recurrent_names": "present_recurrent_names",
}

# the decoder's sizes onnxruntime-genai allocates the cache by, and the config's attribute each must equal
SIZES = {
    "head_size": "head_dim",
    "hidden_size": "hidden_size",
    "num_attention_heads": "num_attention_heads",
    "num_key_value_heads": "num_key_value_heads",
    "num_hidden_layers": "num_hidden_layers",
}


def genai_config_failures(folder: Path, config, context_rows: int | None) -> list[str]:
    """What is wrong in ``folder``'s genai_config.json (none where the export wrote none: Qwen3.8's): each a line
    naming the key; ``context_rows``: the rows of model.onnx's position table, where it has one."""
    genai = read_json(folder / GENAI_CONFIG_FILE)
    if not genai:
        return []
    named = GENAI_CONFIG_FILE
    model, search = genai.get("model", {}), genai.get("search", {})
    decoder = model.get("decoder", {})
    graph_path = folder / str(decoder.get("filename", ""))
    if not decoder.get("filename") or not graph_path.is_file():
        return [f"{named}: model.decoder.filename {decoder.get('filename')!r} is not a graph in the folder"]
    graph = onnx.load(str(graph_path), load_external_data=False).graph
    failures = []
    names = {"inputs": {value.name for value in graph.input}, "outputs": {value.name for value in graph.output}}
    for section, present in names.items():
        for key, name in decoder.get(section, {}).items():
            layers = range(config.num_hidden_layers) if "%d" in name else [None]
            if not any((name % layer if layer is not None else name) in present for layer in layers):
                failures.append(
                    f"{named}: model.decoder.{section}.{key} {name!r} names no {section[:-1]} of {graph_path.name}"
                )
    inputs, outputs = decoder.get("inputs", {}), decoder.get("outputs", {})
    for past_key, present_key in STATE_PAIRS.items():
        past, present = inputs.get(past_key), outputs.get(present_key)
        if isinstance(past, str) and isinstance(present, str):
            expected = past.replace("past_key_values.", "present.", 1)
            if present != expected:
                failures.append(
                    f"{named}: model.decoder.outputs.{present_key} is {present!r}, where the graph's present of "
                    f"inputs.{past_key} {past!r} is {expected!r}"
                )
    for key, attribute in SIZES.items():
        if key in decoder and decoder[key] != getattr(config, attribute):
            failures.append(
                f"{named}: model.decoder.{key} is {decoder[key]}, the model's {attribute} {getattr(config, attribute)}"
            )
    if model.get("vocab_size") not in (None, config.vocab_size):
        failures.append(f"{named}: model.vocab_size is {model['vocab_size']}, the model's {config.vocab_size}")
    context = model.get("context_length")
    if context_rows is not None and isinstance(context, int) and context > context_rows:
        failures.append(f"{named}: model.context_length {context} is past the graph's {context_rows} position rows")
    if isinstance(context, int) and isinstance(search.get("max_length"), int) and search["max_length"] > context:
        failures.append(f"{named}: search.max_length {search['max_length']} is past model.context_length {context}")
    if search.get("past_present_share_buffer"):
        shared = shared_kv_names(graph)
        kv = [value.name for value in graph.input if value.name.endswith((".key", ".value"))]
        unshared = [name for name in kv if name not in shared]
        if unshared:
            failures.append(
                f"{named}: search.past_present_share_buffer is true, but {graph_path.name} cannot write "
                f"{unshared[0]} in place (only GroupQueryAttention's own past can be)"
            )
    return failures
