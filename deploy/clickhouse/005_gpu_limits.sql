-- Each GPU's own slowdown temperature (NVML NVML_TEMPERATURE_THRESHOLD_SLOWDOWN, DCGM field 158), so
-- thermal judgements use the GPU's limit rather than one number for every model. Rows stored before
-- this migration read NaN (not reported).

ALTER TABLE gpu_samples ADD COLUMN IF NOT EXISTS slowdown_temp_c Float64 DEFAULT nan COMMENT 'the GPU''s own slowdown temperature, °C';
