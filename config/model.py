"""The model an experiment names (a preset or an HF config, with overrides) read into a ModelSpec; whether its
fields are sound is models/spec_checks.py's (a converter reads HF configs too)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mcorekit.config.values import shown
from mcorekit.errors import ModelError, first_line
from mcorekit.hub import model_dir
from mcorekit.models.registry import config_problems
from mcorekit.models.spec import ModelSpec, load_hf_config, resolve

MAX_HF_CONFIG_BYTES = 10_000_000  # an HF config.json is a few KB


def resolve_model(preset: str | None, hf_config: str | None, overrides: dict[str, Any] | None) -> ModelSpec:
    """models.spec.resolve, with a broken HF config (not JSON, not an object, keys missing, values of the wrong
    type) reported as one ModelError naming the file instead of the parser's exception."""
    if hf_config is not None and preset is not None:
        raise ModelError(f"model.preset={preset} and model.hf_config={shown(hf_config)} both name the model; give "
                         f"exactly one: set the other to null (e.g. model.preset=null)")
    if hf_config is None:
        return resolve(preset, hf_config, overrides)
    hf_config = str(model_dir(hf_config, "config", "model.hf_config"))  # a Hub ID: its config.json alone
    path = Path(hf_config) / "config.json" if Path(hf_config).is_dir() else Path(hf_config)
    where = f"model.hf_config {shown(path)}"
    if path.is_file() and path.stat().st_size > MAX_HF_CONFIG_BYTES:
        raise ModelError(f"{where}: larger than {MAX_HF_CONFIG_BYTES:,} bytes, so not an HF config.json")
    try:
        config = load_hf_config(hf_config)
        if isinstance(config, dict):  # the model we would build must be this one; how its weights are stored
            # (quantization_config: GPT-OSS's mxfp4, DeepSeek-V3's fp8) is for conversion, not for training
            if problems := config_problems({k: v for k, v in config.items() if k != "quantization_config"}):
                raise ModelError(f"{where}: " + "; ".join(problems))
        return resolve(preset, hf_config, overrides, config)
    except UnicodeDecodeError:
        raise ModelError(f"{where}: not UTF-8 text; name an HF model directory or its config.json") from None
    except json.JSONDecodeError as e:
        raise ModelError(f"{where}: not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
    except RecursionError:
        raise ModelError(f"{where}: not valid JSON (nested too deeply)") from None
    except KeyError as e:
        raise ModelError(f"{where}: has no {e.args[0]!r}, which the model needs") from None
    except (AttributeError, TypeError, ValueError, ArithmeticError) as e:  # ZeroDivisionError, OverflowError too
        raise ModelError(f"{where}: not an HF model config of the expected shape ({type(e).__name__}: "
                         f"{first_line(e)})") from None
