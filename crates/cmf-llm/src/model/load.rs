//! Opening a model from a CMF file (or shard set): the config from the header's `arch` (or, for
//! a model packed under a prefix, from its `{prefix}config_json` blob) and the tensors in place.

use super::{Model, ModelConfig, TensorRef, TensorSource};
use crate::error::{LlmError, Result};
use cmf_format::{CmfModel, Dtype};

/// The tensors of a CMF file or shard set, borrowed from its mapping.
pub struct CmfSource<'a>(pub &'a CmfModel);

impl<'a> TensorSource<'a> for CmfSource<'a> {
    fn tensor(&self, name: &str) -> Option<TensorRef<'a>> {
        let t = self.0.tensor(name)?;
        Some(TensorRef {
            dtype: t.dtype,
            shape: t.shape.as_slice().to_vec(),
            data: t.data,
        })
    }
}

impl ModelConfig {
    /// The config of a plain LLM file: its header's `arch`.
    pub fn from_cmf(file: &CmfModel) -> Result<ModelConfig> {
        let arch = serde_json::to_value(&file.header().arch)
            .map_err(|e| LlmError::Other(format!("{}: header arch: {e}", file.path().display())))?;
        ModelConfig::from_json(&arch)
    }

    /// The config of a model packed under `prefix`: the Hugging Face `config.json` stored as the
    /// u8 tensor `{prefix}config_json` (Z-Image packs: `te.config_json`).
    pub fn from_cmf_blob(file: &CmfModel, prefix: &str) -> Result<ModelConfig> {
        let name = format!("{prefix}config_json");
        let t = file
            .tensor(&name)
            .ok_or_else(|| LlmError::MissingTensor(name.clone()))?;
        if t.dtype != Dtype::U8 {
            return Err(LlmError::Tensor {
                name,
                msg: format!("is {}, expected u8 JSON bytes", t.dtype),
            });
        }
        let v: serde_json::Value =
            serde_json::from_slice(t.data).map_err(|e| LlmError::Tensor {
                name: name.clone(),
                msg: format!("not valid JSON: {e}"),
            })?;
        ModelConfig::from_json(&v)
    }
}

impl<'a> Model<'a> {
    /// Opens the LLM in `file` (config from the header, tensors by their HF names).
    pub fn load(file: &'a CmfModel) -> Result<Model<'a>> {
        Model::from_source(&CmfSource(file), ModelConfig::from_cmf(file)?, "")
    }

    /// Opens a model whose tensors carry a name prefix (`te.model.layers.0…` with prefix `te.`),
    /// with its config from `{prefix}config_json`. `layers` binds only the first that many
    /// decoder layers (e.g. a text encoder that stops early); `None` binds all and the final norm.
    pub fn load_with_prefix(
        file: &'a CmfModel,
        prefix: &str,
        layers: Option<usize>,
    ) -> Result<Model<'a>> {
        let config = ModelConfig::from_cmf_blob(file, prefix)?;
        match layers {
            Some(k) => Model::from_source_layers(&CmfSource(file), config, prefix, k),
            None => Model::from_source(&CmfSource(file), config, prefix),
        }
    }
}
