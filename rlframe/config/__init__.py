"""The trainer config's machinery, below every component that declares a section of it.

- `schema`: declaring keys (`key`, `section`, `Section`), validation, key statuses, the generated YAML.
- `loader`: composing the packaged YAML with Hydra overrides.
- `keys`: the batch-size keys each role reads, and the switches that enable the reference and critic.
- `checks`: accepted names (strategies, checkpoint contents, rollout engines) and file/device checks.
- `key_status`: which keys take effect in a config, and the launch warnings for those that do not.
- `verl_keys`: verl 0.9.1's keys rlframe does not implement: taken at verl's default or refused.
- `trace`: an opt-in record of the keys a run reads (proves nothing is accepted and ignored).

Imports no other rlframe code; the sections themselves live with the components that read them.
"""
