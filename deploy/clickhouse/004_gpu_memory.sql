-- GPU columns added with the probe's dcgm-exporter compatibility (framebuffer, energy, tensor
-- activity). Rows stored before this migration read NaN (not reported), like any field a source
-- does not report.

ALTER TABLE gpu_samples ADD COLUMN IF NOT EXISTS fb_used_mib Float64 DEFAULT nan COMMENT 'framebuffer memory used, MiB';
ALTER TABLE gpu_samples ADD COLUMN IF NOT EXISTS fb_free_mib Float64 DEFAULT nan COMMENT 'framebuffer memory free, MiB';
ALTER TABLE gpu_samples ADD COLUMN IF NOT EXISTS energy_mj Float64 DEFAULT nan COMMENT 'energy consumed since the driver loaded, mJ';
ALTER TABLE gpu_samples ADD COLUMN IF NOT EXISTS tensor_active Float64 DEFAULT nan COMMENT 'share of cycles the tensor pipes were active, 0-1';
