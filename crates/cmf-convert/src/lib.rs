//! cmf-convert
