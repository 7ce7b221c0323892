"""Architecture families, one file each: a module here with a module-level FAMILY (models.registry.Family) is
registered when the registry is first read. What a family says: models/registry.py."""
