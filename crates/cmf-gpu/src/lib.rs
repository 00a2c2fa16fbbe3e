//! cmf-gpu
