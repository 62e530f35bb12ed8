"""The built-in model families of the main job: each module registers one (``models.registry``)."""
