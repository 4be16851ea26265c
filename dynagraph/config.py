"""The base of every typed config section: YAML keys in kebab-case, unknown keys refused.

```python
class RouterConfig(ConfigModel):
    overlap_weight: float = 1.0      # YAML: overlap-weight (overlap_weight also accepted)
```
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


def kebab(name: str) -> str:
    """``max_model_len`` -> ``max-model-len``: how a field is spelled in YAML."""
    return name.replace("_", "-")


class ConfigModel(BaseModel):
    """A config section: kebab-case aliases, snake_case accepted too, extra keys forbidden."""

    model_config = ConfigDict(extra="forbid", alias_generator=kebab, validate_by_name=True,
                              validate_by_alias=True)
