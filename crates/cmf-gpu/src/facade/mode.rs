//! Backend selection: `--gpu auto|off|cuda` on the command line, `CMF_GPU=0|1|cuda` in the
//! environment; the flag wins. `auto` (the default) uses CUDA when a device answers and falls
//! back to the CPU silently; `cuda` insists and is an error when no device is there.

use super::error::GpuError;
use std::str::FromStr;

/// The environment variable read when no `--gpu` flag was given.
pub const ENV_GPU: &str = "CMF_GPU";

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum GpuMode {
    /// Never touch a device.
    Off,
    /// Use CUDA when a device answers; otherwise run on the CPU without complaint.
    #[default]
    Auto,
    /// Require CUDA: opening fails with a clear error when no device answers.
    Cuda,
}

impl GpuMode {
    /// The spelling `--gpu` accepts.
    pub fn name(self) -> &'static str {
        match self {
            GpuMode::Off => "off",
            GpuMode::Auto => "auto",
            GpuMode::Cuda => "cuda",
        }
    }

    /// Parses a `CMF_GPU` value: `0`/`off` → off, `1`/`auto` → auto, `cuda` → cuda.
    pub fn from_env_value(value: &str) -> Result<GpuMode, GpuError> {
        match value.trim().to_ascii_lowercase().as_str() {
            "0" | "off" | "false" | "no" => Ok(GpuMode::Off),
            "1" | "auto" | "" => Ok(GpuMode::Auto),
            "cuda" => Ok(GpuMode::Cuda),
            _ => Err(GpuError::BadSetting {
                what: ENV_GPU.into(),
                value: value.into(),
                expected: "0, 1 or cuda",
            }),
        }
    }

    /// The mode in force: the flag when given, else `CMF_GPU`, else `auto`.
    pub fn resolve(flag: Option<GpuMode>) -> Result<GpuMode, GpuError> {
        Self::resolve_with(flag, std::env::var(ENV_GPU).ok().as_deref())
    }

    /// [`GpuMode::resolve`] with the environment value passed in (testable without touching
    /// the process environment).
    pub fn resolve_with(flag: Option<GpuMode>, env: Option<&str>) -> Result<GpuMode, GpuError> {
        match (flag, env) {
            (Some(mode), _) => Ok(mode),
            (None, Some(v)) => GpuMode::from_env_value(v),
            (None, None) => Ok(GpuMode::Auto),
        }
    }
}

impl FromStr for GpuMode {
    type Err = GpuError;

    /// Parses a `--gpu` value.
    fn from_str(s: &str) -> Result<GpuMode, GpuError> {
        match s.trim().to_ascii_lowercase().as_str() {
            "off" => Ok(GpuMode::Off),
            "auto" => Ok(GpuMode::Auto),
            "cuda" => Ok(GpuMode::Cuda),
            _ => Err(GpuError::BadSetting {
                what: "--gpu".into(),
                value: s.into(),
                expected: "auto, off or cuda",
            }),
        }
    }
}

impl std::fmt::Display for GpuMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flag_wins_over_env() {
        assert_eq!(
            GpuMode::resolve_with(Some(GpuMode::Off), Some("cuda")).unwrap(),
            GpuMode::Off
        );
        assert_eq!(
            GpuMode::resolve_with(Some(GpuMode::Cuda), Some("0")).unwrap(),
            GpuMode::Cuda
        );
    }

    #[test]
    fn env_values() {
        assert_eq!(
            GpuMode::resolve_with(None, Some("0")).unwrap(),
            GpuMode::Off
        );
        assert_eq!(
            GpuMode::resolve_with(None, Some("1")).unwrap(),
            GpuMode::Auto
        );
        assert_eq!(
            GpuMode::resolve_with(None, Some("cuda")).unwrap(),
            GpuMode::Cuda
        );
        assert_eq!(GpuMode::resolve_with(None, None).unwrap(), GpuMode::Auto);
        let err = GpuMode::resolve_with(None, Some("metal")).unwrap_err();
        assert!(err.to_string().contains("CMF_GPU"), "{err}");
    }

    #[test]
    fn flag_values() {
        assert_eq!("auto".parse::<GpuMode>().unwrap(), GpuMode::Auto);
        assert_eq!("OFF".parse::<GpuMode>().unwrap(), GpuMode::Off);
        assert_eq!("cuda".parse::<GpuMode>().unwrap(), GpuMode::Cuda);
        let err = "1".parse::<GpuMode>().unwrap_err();
        assert!(err.to_string().contains("--gpu"), "{err}");
    }
}
