"""The one exception type that the command line turns into a one-line error and a non-zero exit.

Raise ``ThinkerError`` for anything the user can fix (a wrong path, a tensor that does not fit the config, a
missing file). The message must name the file, tensor or key that is wrong and say what to do. Any other
exception is a bug and keeps its traceback.
"""


class ThinkerError(Exception):
    """A user-facing error: its message is printed as one line, without a traceback."""


# The config peft's save_pretrained writes for an adapter, in place of a model's config.json.
ADAPTER_CONFIG = "adapter_config.json"


def peft_adapter_error(evidence: str) -> ThinkerError:
    """A PEFT adapter given as SOURCE (peft's ``save_pretrained``: ``adapter_config.json``, ``adapter_model.*``, tensor
    names under ``base_model.model.``), with what gave it away: it is no model until merged into its base."""
    return ThinkerError(
        f"the source holds a PEFT adapter ({evidence}), not a model: merge it into its base model first (peft's "
        "PeftModel.from_pretrained(base, SOURCE).merge_and_unload().save_pretrained(FOLDER)) and convert FOLDER"
    )
