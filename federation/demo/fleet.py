"""The demo fleet: three regions in three jurisdictions, heterogeneous pools, three model
sizes, two LoRA adapters, tenants with different residency policies.

Plain data, applied through the services by ``fedinfer loaddemo`` (idempotent). Figures are
realistic: prices per GPU-hour as seen on public price lists in 2025-26, model shapes from the
published configs (layers, attention and KV heads, head size).
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any

#: Password of the demo users in embedded mode (``loaddemo --password`` sets another).
DEMO_PASSWORD = "fedinfer-demo"

REGIONS: list[dict[str, Any]] = [
    {
        "code": "us-east",
        "name": "US East (Virginia)",
        "provider": "cloud",
        "latitude": 38.9,
        "longitude": -77.4,
        "jurisdiction": "US",
    },
    {
        "code": "eu-west",
        "name": "EU West (Dublin)",
        "provider": "cloud",
        "latitude": 53.3,
        "longitude": -6.3,
        "jurisdiction": "EU",
    },
    {
        "code": "ap-southeast",
        "name": "Asia-Pacific South-East (Singapore)",
        "provider": "neocloud",
        "latitude": 1.35,
        "longitude": 103.8,
        "jurisdiction": "APAC",
    },
]

# Symmetric configured round-trip times, milliseconds.
RTT_MS: list[tuple[str, str, float]] = [
    ("us-east", "eu-west", 75.0),
    ("us-east", "ap-southeast", 220.0),
    ("eu-west", "ap-southeast", 160.0),
]

POOLS: list[dict[str, Any]] = [
    {
        "region": "us-east",
        "name": "h100-nvlink",
        "accelerator": "H100-80G",
        "gpus_per_node": 8,
        "node_count": 4,
        "interconnect": "nvlink",
        "rdma": True,
        "price_per_gpu_hour": Decimal("2.49"),
        "capacity_type": "on_demand",
    },
    {
        "region": "us-east",
        "name": "l4-spot",
        "accelerator": "L4-24G",
        "gpus_per_node": 4,
        "node_count": 6,
        "interconnect": "pcie",
        "rdma": False,
        "price_per_gpu_hour": Decimal("0.32"),
        "capacity_type": "spot",
    },
    {
        "region": "eu-west",
        "name": "a100-pcie",
        "accelerator": "A100-80G",
        "gpus_per_node": 4,
        "node_count": 4,
        "interconnect": "pcie",
        "rdma": False,
        "price_per_gpu_hour": Decimal("1.79"),
        "capacity_type": "reserved",
    },
    {
        "region": "eu-west",
        "name": "l4",
        "accelerator": "L4-24G",
        "gpus_per_node": 4,
        "node_count": 4,
        "interconnect": "pcie",
        "rdma": False,
        "price_per_gpu_hour": Decimal("0.55"),
        "capacity_type": "on_demand",
    },
    {
        "region": "ap-southeast",
        "name": "h100-neo",
        "accelerator": "H100-80G",
        "gpus_per_node": 8,
        "node_count": 2,
        "interconnect": "nvlink",
        "rdma": True,
        "price_per_gpu_hour": Decimal("2.10"),
        "capacity_type": "reserved",
    },
    {
        "region": "ap-southeast",
        "name": "l40s",
        "accelerator": "L40S-48G",
        "gpus_per_node": 4,
        "node_count": 2,
        "interconnect": "pcie",
        "rdma": False,
        "price_per_gpu_hour": Decimal("0.95"),
        "capacity_type": "on_demand",
    },
]

MODELS: list[dict[str, Any]] = [
    {
        "name": "meta-llama/Llama-3.1-8B-Instruct",
        "family": "llama-3.1",
        "parameter_count_b": Decimal("8.03"),
        "dtype": "bf16",
        "weight_size_gib": 14.96,
        "max_context_tokens": 131072,
        "num_layers": 32,
        "num_attention_heads": 32,
        "num_kv_heads": 8,
        "head_dim": 128,
    },
    {
        "name": "Qwen/Qwen2.5-32B-Instruct",
        "family": "qwen-2.5",
        "parameter_count_b": Decimal("32.76"),
        "dtype": "bf16",
        "weight_size_gib": 61.0,
        "max_context_tokens": 32768,
        "num_layers": 64,
        "num_attention_heads": 40,
        "num_kv_heads": 8,
        "head_dim": 128,
    },
    {
        "name": "meta-llama/Llama-3.3-70B-Instruct",
        "family": "llama-3.3",
        "parameter_count_b": Decimal("70.55"),
        "dtype": "bf16",
        "weight_size_gib": 131.4,
        "max_context_tokens": 131072,
        "num_layers": 80,
        "num_attention_heads": 64,
        "num_kv_heads": 8,
        "head_dim": 128,
    },
]

#: List prices, USD per million tokens (input, cached input, output), in the range of public
#: per-token prices of hosted open models in 2025-26; Initech has negotiated its own for 8B.
PRICES: list[tuple[str, str | None, str, str, str]] = [
    ("meta-llama/Llama-3.1-8B-Instruct", None, "0.10", "0.05", "0.30"),
    ("Qwen/Qwen2.5-32B-Instruct", None, "0.40", "0.20", "1.20"),
    ("meta-llama/Llama-3.3-70B-Instruct", None, "0.60", "0.30", "1.80"),
    ("meta-llama/Llama-3.1-8B-Instruct", "initech", "0.08", "0.02", "0.24"),
]

ADAPTERS: list[dict[str, Any]] = [
    {
        "base_model": "meta-llama/Llama-3.1-8B-Instruct",
        "name": "llama-8b-support-agent",
        "rank": 16,
        "source": "s3://fedinfer-demo/adapters/support-agent",
    },
    {
        "base_model": "meta-llama/Llama-3.1-8B-Instruct",
        "name": "llama-8b-sql",
        "rank": 32,
        "source": "s3://fedinfer-demo/adapters/sql",
    },
]

# (region, pool, model, role, TP, min, desired, max, adapters)
DEPLOYMENTS: list[tuple[str, str, str, str, int, int, int, int, list[str]]] = [
    ("us-east", "h100-nvlink", "meta-llama/Llama-3.3-70B-Instruct", "prefill", 4, 1, 1, 2, []),
    ("us-east", "h100-nvlink", "meta-llama/Llama-3.3-70B-Instruct", "decode", 4, 1, 1, 3, []),
    (
        "us-east",
        "h100-nvlink",
        "meta-llama/Llama-3.1-8B-Instruct",
        "mixed",
        1,
        1,
        2,
        4,
        ["llama-8b-support-agent", "llama-8b-sql"],
    ),
    ("us-east", "l4-spot", "meta-llama/Llama-3.1-8B-Instruct", "mixed", 2, 0, 2, 6, []),
    ("eu-west", "a100-pcie", "Qwen/Qwen2.5-32B-Instruct", "mixed", 2, 1, 2, 4, []),
    (
        "eu-west",
        "a100-pcie",
        "meta-llama/Llama-3.1-8B-Instruct",
        "mixed",
        1,
        1,
        2,
        4,
        ["llama-8b-support-agent"],
    ),
    ("eu-west", "l4", "meta-llama/Llama-3.1-8B-Instruct", "mixed", 2, 0, 1, 4, []),
    ("ap-southeast", "h100-neo", "meta-llama/Llama-3.3-70B-Instruct", "mixed", 4, 1, 1, 2, []),
    ("ap-southeast", "h100-neo", "meta-llama/Llama-3.1-8B-Instruct", "mixed", 1, 1, 2, 4, []),
    ("ap-southeast", "l40s", "Qwen/Qwen2.5-32B-Instruct", "mixed", 2, 0, 1, 2, []),
]

TENANTS: list[dict[str, Any]] = [
    {
        "slug": "acme-us",
        "name": "Acme Corp (US data only)",
        "allowed_jurisdictions": ["US"],
        "requests_per_minute": 600,
        "tokens_per_minute": 400_000,
        "monthly_budget_usd": Decimal("5000.00"),
    },
    {
        "slug": "globex-eu",
        "name": "Globex GmbH (GDPR: EU only)",
        "allowed_jurisdictions": ["EU"],
        "requests_per_minute": 300,
        "tokens_per_minute": 200_000,
        "monthly_budget_usd": Decimal("2000.00"),
    },
    {
        "slug": "umbrella-sg",
        "name": "Umbrella Pte (Singapore region only)",
        "allowed_jurisdictions": ["APAC"],
        "allowed_regions": ["ap-southeast"],
        "requests_per_minute": 120,
        "tokens_per_minute": 100_000,
        "monthly_budget_usd": Decimal("800.00"),
    },
    {
        "slug": "initech",
        "name": "Initech (anywhere, cheapest first)",
        "allowed_jurisdictions": [],
        "requests_per_minute": None,
        "tokens_per_minute": None,
        "monthly_budget_usd": Decimal("10000.00"),
    },
]
