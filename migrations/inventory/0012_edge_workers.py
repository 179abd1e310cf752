from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("inventory", "0011_pool_revisions"),
    ]

    operations = [
        migrations.AddField(
            model_name="edge",
            name="workers",
            field=models.PositiveSmallIntegerField(
                default=1,
                help_text="Worker processes it runs on its port, as its heartbeats say: each "
                "holds budget leases of its own and is one of the region's edges for "
                "rate-limit shares.",
            ),
        ),
    ]
