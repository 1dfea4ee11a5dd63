"""neuron-monitor reports, and what its Prometheus exporter serves for them, in a real job's shape.

The shape follows public output (tests/fixtures/memory/README.md names each sample): one runtime per
process in ``neuron_runtime_data``; each runtime's ``neuroncore_memory_usage`` lists every NeuronCore
of the instance, zeros on the cores the process does not use; the runtimes may share one
``neuron_runtime_tag`` ("1" in the four-process sample); ``neuron_runtime_vcpu_usage`` carries
``open /proc/<pid>/stat: no such file or directory`` while ``memory_used`` is fine; a used trn1
NeuronCore's ``model_code`` holds the runtime's microcode, 100,752,896 B. The exposition is what
``neuron-monitor-prometheus.py`` serves: per category one gauge family, one series per label set
(labels sorted; the runtime named by ``runtime_tag`` only, no pid), the last write to a series
winning, values as prometheus_client writes them (``1.00752896e+08``).
"""

from __future__ import annotations

import json
from pathlib import Path

from neuron_ckpt.memory.readers import NEURON_CATEGORIES

MICROCODE = 100752896
TRN1_32XL = 32  # NeuronCores of a trn1.32xlarge: 16 devices x 2


def held(scratchpad: int, tensors: int, constants: int = 0) -> dict[str, int]:
    """What one training process holds on its NeuronCore."""
    return {
        "constants": constants,
        "model_code": MICROCODE,
        "model_shared_scratchpad": scratchpad,
        "runtime_memory": 43216,
        "tensors": tensors,
    }


def runtime(pid: int, tag: str, cores: int, holds: dict[int, dict[str, int]]) -> dict:
    """One process's entry: ``holds`` maps the cores it holds bytes on to their categories; the
    instance's other cores (of ``cores``) read zeros."""
    usage = {str(c): {k: holds.get(c, {}).get(k, 0) for k in NEURON_CATEGORIES} for c in range(cores)}
    zeros = dict.fromkeys(("generic", "numerical", "transient", "model", "runtime", "hardware"), 0)
    return {
        "pid": pid,
        "neuron_runtime_tag": tag,
        "error": "",
        "report": {
            "execution_stats": {
                "period": 5.0007,
                "error_summary": zeros,
                "execution_summary": {"completed": 50},
                "latency_stats": {"total_latency": None, "device_latency": None},
                "error": "",
            },
            "memory_used": {
                "period": 5.0007,
                "neuron_runtime_used_bytes": {
                    "host": 2605992,
                    "neuron_device": sum(sum(v.values()) for v in usage.values()),
                    "usage_breakdown": {
                        "host": {"application_memory": 12328, "constants": 0, "dma_buffers": 16384, "tensors": 2577280},
                        "neuroncore_memory_usage": usage,
                    },
                },
                "loaded_models": [],
                "error": "",
            },
            "neuron_runtime_vcpu_usage": {
                "period": 5.0008,
                "vcpu_usage": {"user": 0, "system": 0},
                "error": f"open /proc/{pid}/stat: no such file or directory",
            },
            "neuroncore_counters": {
                "period": 5.0007,
                "neuroncores_in_use": {
                    str(c): {"neuroncore_utilization": 2.9 if c in holds else 0} for c in range(cores)
                },
                "error": "",
            },
        },
    }


def report(runtimes: list[dict], cores: int = TRN1_32XL) -> dict:
    """One line of neuron-monitor's output."""
    return {
        "neuron_runtime_data": runtimes,
        "system_data": {
            "memory_info": {
                "period": 5.0115,
                "memory_total_bytes": 532523487232,
                "memory_used_bytes": 76337672192,
                "swap_total_bytes": 0,
                "swap_used_bytes": 0,
                "error": "",
            }
        },
        "instance_info": {
            "instance_name": "",
            "instance_id": "i-0abc",
            "instance_type": "trn1.32xlarge",
            "instance_availability_zone": "us-east-1c",
            "instance_region": "us-east-1",
            "subnet_id": "subnet-1",
            "error": "",
        },
        "neuron_hardware_info": {"neuron_device_count": cores // 2, "neuroncore_per_device_count": 2, "error": ""},
    }


def job(cores_used: range, cores: int, holds: dict[str, int], tag: str = "1", pid: int = 20843) -> list[dict]:
    """A training job's runtimes: one process per NeuronCore in ``cores_used``, each holding
    ``holds``; ``tag`` may name the rank (``"rank{rank}"``) or be shared (``"1"``)."""
    return [runtime(pid + 207 * n, tag.format(rank=n), cores, {core: holds}) for n, core in enumerate(cores_used)]


def write_lines(path: Path, reports: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in reports), encoding="utf-8")
    return path


def _number(value: int) -> str:
    """prometheus_client's float text: Python's, with an exponent from seven integer digits on."""
    text = repr(float(value))
    whole, _, fraction = text.partition(".")
    if value <= 0 or len(whole) < 7:
        return text
    return f"{(whole[0] + '.' + whole[1:] + fraction).rstrip('0').rstrip('.')}e+0{len(whole) - 1}"


def exposition(line: dict) -> str:
    """One scrape of the exporter after it processed ``line``."""
    info = line["instance_info"]
    base = {
        "availability_zone": info["instance_availability_zone"],
        "instance_id": info["instance_id"],
        "instance_name": info["instance_name"],
        "instance_type": info["instance_type"],
        "region": info["instance_region"],
        "subnet_id": info["subnet_id"],
    }
    families: dict[str, dict[str, int]] = {category: {} for category in NEURON_CATEGORIES}
    for entry in line["neuron_runtime_data"]:
        usage = entry["report"]["memory_used"]["neuron_runtime_used_bytes"]["usage_breakdown"]
        for category, series in families.items():
            for core, values in usage["neuroncore_memory_usage"].items():
                labels = {
                    **base,
                    "memory_location": "None",
                    "neuroncore": core,
                    "runtime_tag": entry["neuron_runtime_tag"],
                }
                series[",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))] = values[category]
    out = [
        "# HELP python_info Python platform information",
        "# TYPE python_info gauge",
        'python_info{implementation="CPython",major="3",minor="8",patchlevel="10",version="3.8.10"} 1.0',
        "process_open_fds 6.0",
    ]
    for category, series in families.items():
        name = f"neuroncore_memory_usage_{category}"
        out += [f"# HELP {name} NeuronCore memory utilization for {category}", f"# TYPE {name} gauge"]
        out += [f"{name}{{{labels}}} {_number(value)}" for labels, value in series.items()]
    return "\n".join(out) + "\n"
