"""Seed the accelerator catalog. Data is inline: migrations never import app code."""

from django.db import migrations

# name, vendor, memory GiB, speed relative to H100-80G, memory bandwidth GB/s, high-bandwidth GPU link
CATALOG = [
    ("B200-192G", "NVIDIA", 192, 2.2, 8000, True),
    ("H200-141G", "NVIDIA", 141, 1.25, 4800, True),
    ("H100-80G", "NVIDIA", 80, 1.0, 3350, True),
    ("H20-96G", "NVIDIA", 96, 0.45, 4000, True),
    ("A100-80G", "NVIDIA", 80, 0.55, 2039, True),
    ("A100-40G", "NVIDIA", 40, 0.5, 1555, True),
    ("L40S-48G", "NVIDIA", 48, 0.45, 864, False),
    ("L4-24G", "NVIDIA", 24, 0.14, 300, False),
    ("MI300X-192G", "AMD", 192, 1.1, 5300, True),
    ("K100-48G", "Hygon", 48, 0.3, 896, False),
]


def seed(apps, schema_editor):
    AcceleratorType = apps.get_model("inventory", "AcceleratorType")
    for name, vendor, memory, speed, bandwidth, link in CATALOG:
        AcceleratorType.objects.update_or_create(
            name=name,
            defaults={
                "vendor": vendor,
                "memory_gib": memory,
                "relative_speed": speed,
                "memory_bandwidth_gbps": bandwidth,
                "supports_nvlink": link,
            },
        )


def unseed(apps, schema_editor):
    apps.get_model("inventory", "AcceleratorType").objects.filter(
        name__in=[row[0] for row in CATALOG], pools__isnull=True
    ).delete()


class Migration(migrations.Migration):
    dependencies = [("inventory", "0001_initial")]
    operations = [migrations.RunPython(seed, unseed)]
