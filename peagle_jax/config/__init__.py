"""What shapes a target and a head, as frozen data: `target_config` (TargetConfig, RopeConfig,
ConfigError, the aux-layer convention), `drafter_config` (DrafterConfig), `fields` (the
config.json field specs both read) and `dtypes` (dtypes by name). Imports nothing but each other."""
