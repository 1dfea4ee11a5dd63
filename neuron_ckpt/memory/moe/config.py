"""Reading a transformers config.json, any family's, any version's, into a
:class:`~.shape.MoEShape`: :func:`load_moe_config`.

One reader for every family of :mod:`.families`: ``model_type`` picks transformers' own config
class, which reads the file as ``from_pretrained`` would (its ``attribute_map`` renames,
``rope_theta`` into ``rope_parameters``, ``torch_dtype`` into ``dtype``, ``layer_types`` from
``max_window_layers``...), and :mod:`.from_config` takes the sizes from the class's object. So:

* **Read**: every key whose value changes what a layer keeps or how the plan splits it.
* **Accepted, named in one notice**: every other key, found by changing its value (a number,
  a bool flipped, anything else dropped: :func:`_perturbed`) and seeing the shape stay the same: with sliding
  windows off ``max_window_layers`` changes nothing, nor does ``torch_dtype`` (the job's dtype is
  priced), ``use_cache``, ``rope_theta``... A key the installed config class does not have (a
  newer or older version's) is such a key too, as transformers ignores it.
* **Refused, one ``ValueError`` naming the file and every problem**: a misspelling of a key that
  matters (an unknown key close to a key the file lacks and whose value changes the shape:
  ``num_hidden_layer``), a missing size (:attr:`~.families.Family.required`: transformers would
  use its default), a value of the wrong type (the class's own strict check), what the memory
  model does not price (:func:`~.from_config.unpriced`), DeepSeek remote-code routing other than
  transformers' (:data:`REMOTE_VALUES`).

A ``quantization_config`` (DeepSeek-V3 ships fp8 weights) is dropped with a notice:
``Model(config)`` builds the model in its dtype and so does this. A multimodal wrapper
(``llama4``, ``aria``) is read through its ``text_config``, with a notice.

Presets (:data:`PRESET_NAMES`): the JSON files in ``presets/``: ``mixtral-8x7b``, ``deepseek-v3``
and ``qwen3-8b``, their public config.json as transformers reads it (fp8 quantization stripped);
the Llama presets of :mod:`neuron_ckpt.models.config_file` are found too.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import difflib
import functools
import logging
import warnings
from pathlib import Path

from ...models.config_file import METADATA_KEYS, read_json_object
from ...models.config_file import PRESET_NAMES as LLAMA_PRESETS
from ...models.config_file import config_path as find_config
from .families import FAMILIES, FAMILY
from .from_config import shape_of, unpriced
from .shape import MoEShape

PRESETS_DIR = Path(__file__).with_name("presets")
PRESET_NAMES = tuple(sorted(p.stem for p in PRESETS_DIR.glob("*.json")))
CONFIG_CLASSES = {name: family.config_class for name, family in FAMILY.items()}
WRAPPERS = {"llama4": "llama4_text", "aria": "aria_text"}  # multimodal configs: their text_config is the LM
SILENT = frozenset({"architectures", "model_type", "transformers_version", "_name_or_path", "_commit_hash"})

# Keys of DeepSeek's own config.json (its remote code) that transformers' config classes lack, with
# the value transformers' implementation means; a file giving another value describes another model.
REMOTE_VALUES = {
    "deepseek_v2": {"scoring_func": "softmax", "moe_layer_freq": 1},
    "deepseek_v3": {"scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1},
}
DEEPSEEK_REMOTE_KEYS = {"auto_map": None, "aux_loss_alpha": None, "seq_aux": None, "ep_size": None,
                        **REMOTE_VALUES["deepseek_v3"]}  # fmt: skip
_DROPPED = object()


def _config_class(family: str):
    import transformers

    return getattr(transformers, CONFIG_CLASSES[family])


@functools.cache
def _fields(family: str) -> frozenset[str]:
    """The keys the installed transformers' config class of ``family`` reads."""
    cls = _config_class(family)
    return frozenset(cls().to_dict()) | frozenset(cls.attribute_map)


@functools.cache
def _known_keys() -> frozenset[str]:
    """Keys some transformers config class of these families reads: another family's (or
    version's) key, not a misspelling."""
    return frozenset().union(*(_fields(f) for f in FAMILIES)) | METADATA_KEYS


@contextlib.contextmanager
def quiet_transformers():
    """transformers' warnings off while the reader rebuilds configs (RoPE checks warn per build)."""
    logger = logging.getLogger("transformers")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)


def _build(data: dict, family: str):
    """transformers' config object of ``data``; its strict checks as one ``ValueError``."""
    known = {k: v for k, v in data.items() if k not in REMOTE_VALUES.get(family, {})}
    try:
        return _config_class(family).from_dict(copy.deepcopy(known))
    except Exception as exc:  # noqa: BLE001  its checks raise many kinds; re-raised as one ValueError
        raise ValueError(f"transformers.{CONFIG_CLASSES[family]} refuses it: {' '.join(str(exc).split())}") from None


def _derive(data: dict, family: str) -> MoEShape:
    """The shape of ``data``; a ``ValueError`` where it is refused or not priced."""
    config = _build(data, family)
    problems = unpriced(config, family)
    if problems:
        raise ValueError("; ".join(problems))
    return shape_of(config, family)


def _perturbed(value):
    """Another value for a key: a bool flipped, a number changed, an empty list of layers given
    one; anything else dropped (transformers' default, or what it derives from the other keys)."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value * 2 + 1
    return [0] if value == [] else _DROPPED


def _changes_shape(data: dict, key: str, value, family: str, base: MoEShape) -> bool:
    """Whether giving ``key`` another value than ``value`` changes the shape (or is refused)."""
    other = _perturbed(value)
    changed = {k: v for k, v in data.items() if k != key} | ({} if other is _DROPPED else {key: other})
    try:
        return _derive(changed, family) != base
    except ValueError:
        return True


def _problems(data: dict, family: str) -> list[str]:
    """Missing sizes (with a misspelling of them the file holds) and remote-code values."""
    fields, problems = _fields(family), []
    unknown = [k for k in data if k not in fields and k not in METADATA_KEYS]
    for names in FAMILY[family].required:
        if not any(n in data for n in names):
            guess = difflib.get_close_matches(names[0], unknown, n=1, cutoff=0.6)
            hint = f"; is {guess[0]!r} a misspelling of it?" if guess else ""
            default = _config_class(family)().to_dict().get(names[0])
            problems.append(f"missing key {names[0]!r} (transformers would use its default {default!r}{hint})")
    for key, want in REMOTE_VALUES.get(family, {}).items():
        if key in data and data[key] != want:
            problems.append(f"{key} is {data[key]!r}: transformers' {family} implements {want!r} only")
    return problems


def _misspelt(data: dict, family: str, config, base: MoEShape) -> list[str]:
    """Unknown keys close to a key the file lacks whose value changes the shape."""
    fields = _fields(family)
    absent = sorted(k for k in fields if k not in data and hasattr(config, k))
    problems = []
    for key in (k for k in data if k not in _known_keys() and k not in REMOTE_VALUES.get(family, {})):
        for guess in difflib.get_close_matches(key, absent, n=3, cutoff=0.6):
            if _changes_shape(data, guess, getattr(config, guess), family, base):
                problems.append(f"unknown key {key!r} (did you mean {guess!r}?)")
                break
    return problems


def moe_shape_from_dict(
    data: dict, source: str = "the model config", name: str = "", notices: list[str] | None = None
) -> MoEShape:
    """The :class:`MoEShape` of a parsed config.json, or one ``ValueError`` starting with ``source``
    listing every problem (module docstring). ``notices``: where the notices go (a dropped
    ``quantization_config``, a wrapper's ``text_config`` read, the keys that change nothing);
    None: warnings, for what was dropped or read elsewhere (the keys that change nothing are
    then not named: nothing of theirs is lost)."""
    said: list[str] = []
    family = data.get("model_type")
    if family in WRAPPERS and isinstance(data.get("text_config"), dict):
        said.append(
            f"{source}: model_type {family!r}: its text_config (the language model) is priced, not the vision tower"
        )
        data, family = {**data["text_config"], "model_type": WRAPPERS[family]}, WRAPPERS[family]
    if family not in FAMILIES:
        raise ValueError(f"{source}: model_type is {family!r}: this reads the families {list(FAMILIES)}")
    data = dict(data)
    if data.pop("quantization_config", None) is not None:
        said.append(
            f"{source}: quantization_config dropped: priced as Model(config) builds it, in the model's dtype "
            "(activations do not depend on how the weights are stored)"
        )
    with quiet_transformers():
        shape = _read(data, family, source, name, said if notices is not None else [])
    for notice in said:
        notices.append(notice) if notices is not None else warnings.warn(notice, stacklevel=2)
    return shape


def _read(data: dict, family: str, source: str, name: str, said: list[str]) -> MoEShape:
    problems = _problems(data, family)
    if problems:
        raise ValueError(f"{source}: " + "; ".join(problems))
    try:
        config = _build(data, family)
        problems = unpriced(config, family)
        base = shape_of(config, family) if not problems else None
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from None
    if base is None:
        raise ValueError(f"{source}: " + "; ".join(problems))
    problems = _misspelt(data, family, config, base)
    if problems:
        raise ValueError(f"{source}: " + "; ".join(problems))
    required = {n for names in FAMILY[family].required for n in names}
    idle = [k for k in data if k not in SILENT | required and not _changes_shape(data, k, data[k], family, base)]
    if idle:
        foreign = [k for k in idle if k not in _fields(family) | METADATA_KEYS]
        said.append(
            f"{source}: accepted, each of these alone changes nothing priced here: {', '.join(idle)}"
            + (f" ({', '.join(foreign)}: not transformers.{CONFIG_CLASSES[family]} fields)" if foreign else "")
        )
    return dataclasses.replace(base, name=name)


def config_path(path_or_name: str | Path) -> Path:
    """The JSON file of a preset name (these, then :mod:`neuron_ckpt.models.config_file`'s), a
    directory's ``config.json``, or the file itself."""
    if str(path_or_name).lower() in PRESET_NAMES:
        return PRESETS_DIR / f"{str(path_or_name).lower()}.json"
    try:
        return find_config(path_or_name)
    except ValueError:
        presets = ", ".join(sorted(PRESET_NAMES + LLAMA_PRESETS))
        raise ValueError(
            f"{path_or_name}: no such file, directory holding config.json, or preset ({presets})"
        ) from None


def load_moe_config(path_or_name: str | Path, notices: list[str] | None = None) -> MoEShape:
    """The :class:`MoEShape` of a config.json file, a directory holding one, or a preset name."""
    path = config_path(path_or_name)
    name = path.stem if path.parent == PRESETS_DIR else path.parent.name if path.name == "config.json" else path.stem
    return moe_shape_from_dict(read_json_object(path), str(path), name, notices)


__all__ = [
    "CONFIG_CLASSES",
    "DEEPSEEK_REMOTE_KEYS",
    "PRESET_NAMES",
    "REMOTE_VALUES",
    "config_path",
    "load_moe_config",
    "moe_shape_from_dict",
    "quiet_transformers",
]
