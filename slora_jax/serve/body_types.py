"""Field types for the arrays and objects of untrusted request bodies: validation that costs little whatever they hold.

Why: for a plain ``list[int]`` pydantic records one error per bad item, once per branch of a union, and FastAPI turns
every error into a dict, all on the event loop. A 4 MiB body holding one chat message with ``content: [1, 1, ...]``
(2M items) held every stream of the server for ~45 s and took ~7 GB. Each list type here stops at its first bad item
(``fail_fast``) and most have a length cap, which pydantic checks before the items. A dict's ``max_length`` is checked
only after every entry was validated, so :func:`capped_dict` counts its entries first.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BeforeValidator, Field, StrictFloat

from ..engine.sampling import MAX_LOGIT_BIAS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS
from ..lora.mixes import MAX_MIX_PARTS

__all__ = ["AdapterWeights", "ContentParts", "GuidedChoices", "LogitBias", "PromptBatch", "StopStrings",
           "StopTokenIds", "TokenBatch", "TokenIds", "ToolList", "capped_dict"]

# Caps where the engine has none of its own: parts in one chat message, choices of guided_choice, tools (refused
# when given), prompts of a batch (refused past one: the cap only bounds the work before that clearer refusal)
MAX_CONTENT_PARTS = 16384
MAX_GUIDED_CHOICES = 16384
MAX_TOOLS = 1024
MAX_PROMPT_BATCH = 64


def capped_dict(max_entries: int) -> BeforeValidator:
    """A validator refusing an object of more than ``max_entries`` entries before any entry is validated."""

    def check(value: Any) -> Any:
        if isinstance(value, dict) and len(value) > max_entries:
            raise ValueError(f"at most {max_entries} entries are accepted, got {len(value)}")
        return value

    return BeforeValidator(check)


TokenIds = Annotated[list[int], Field(fail_fast=True)]  # a prompt's ids: bounded by the body and the context
TokenBatch = Annotated[list[TokenIds], Field(fail_fast=True, max_length=MAX_PROMPT_BATCH)]
PromptBatch = Annotated[list[str], Field(fail_fast=True, max_length=MAX_PROMPT_BATCH)]
StopStrings = Annotated[list[str], Field(fail_fast=True, max_length=MAX_STOP_STRINGS)]
StopTokenIds = Annotated[list[int], Field(fail_fast=True, max_length=MAX_STOP_TOKEN_IDS)]
GuidedChoices = Annotated[list[str], Field(fail_fast=True, max_length=MAX_GUIDED_CHOICES)]
ContentParts = Annotated[list[dict[str, Any] | str], Field(fail_fast=True, max_length=MAX_CONTENT_PARTS)]
ToolList = Annotated[list[dict[str, Any]], Field(fail_fast=True, max_length=MAX_TOOLS)]
LogitBias = Annotated[dict[str, float], capped_dict(MAX_LOGIT_BIAS)]
AdapterWeights = Annotated[dict[str, StrictFloat], capped_dict(MAX_MIX_PARTS)]
