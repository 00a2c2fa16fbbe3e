//! cmf-llm
