"""What a run is made of and records: the resolved config (runconfig), the identity of models and data
(identity), the environment of a run (provenance), hub access (hub)."""
