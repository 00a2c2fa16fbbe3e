//! Flow-matching Euler schedule with a static shift, in the exact f32 arithmetic of diffusers.
//!
//! Reference: `ZImagePipeline.__call__` (`get_default_z_image_sigmas`) and
//! `FlowMatchEulerDiscreteScheduler.set_timesteps` / `.step` (diffusers 0.42.1):
//! - `s = torch.linspace(1, 1/N, N)` (f32),
//! - `σ = shift·s / (1 + (shift − 1)·s)` (numpy f32), then a terminal `σ_N = 0`,
//! - `timestep_i = σ_i · 1000`, and the DiT is called at `t_i = (1000 − timestep_i) / 1000`,
//! - Euler step on the negated model output: `x += (σ_{i+1} − σ_i) · (−model_out)`.
//!
//! Every operation is one f32 rounding, in the order above, so the sequences are bit-equal to the
//! Python ones (tested against `fixtures/zimage/expected/scheduler.safetensors`).

/// The per-step values of one schedule.
#[derive(Clone, Debug, PartialEq)]
pub struct Schedule {
    /// `σ_0 … σ_N` (N + 1 values, the last is 0).
    pub sigmas: Vec<f32>,
    /// `σ_i · 1000` (N values), the scheduler's `timesteps`.
    pub timesteps: Vec<f32>,
    /// The DiT's time input `(1000 − timestep_i) / 1000` (N values).
    pub model_t: Vec<f32>,
}

impl Schedule {
    /// The Z-Image default schedule for `steps` steps (≥ 1) and a static `shift`.
    pub fn new(steps: usize, shift: f32) -> Schedule {
        assert!(steps >= 1, "a schedule needs at least one step");
        // `1 / num_inference_steps` is a Python double that torch rounds to f32.
        let end = (1.0f64 / steps as f64) as f32;
        let mut sigmas: Vec<f32> = linspace_f32(1.0, end, steps)
            .into_iter()
            .map(|s| {
                let num = shift * s;
                let den = 1.0 + (shift - 1.0) * s;
                num / den
            })
            .collect();
        let timesteps: Vec<f32> = sigmas.iter().map(|&s| s * 1000.0).collect();
        let model_t = timesteps.iter().map(|&t| (1000.0 - t) / 1000.0).collect();
        sigmas.push(0.0);
        Schedule {
            sigmas,
            timesteps,
            model_t,
        }
    }

    pub fn steps(&self) -> usize {
        self.timesteps.len()
    }

    /// One Euler step in place: `x += (σ_{i+1} − σ_i) · (−v)` where `v` is the (guided) model output.
    pub fn step(&self, i: usize, x: &mut [f32], v: &[f32]) {
        assert_eq!(x.len(), v.len());
        let dt = self.sigmas[i + 1] - self.sigmas[i];
        for (xi, &vi) in x.iter_mut().zip(v) {
            *xi += dt * -vi;
        }
    }
}

/// `torch.linspace(start, end, n)` for f32 on the CPU (aten `linspace_kernel`, a scalar loop): the
/// first half counts up from `start` (`start + step·i`), the second half down from `end`
/// (`end − step·(n−1−i)`), `step = (end − start) / (n − 1)` in f32. The x86-64 torch build contracts
/// each `a ± step·i` into one fused multiply-add (one rounding); `mul_add` does the same. Checked
/// bit-exact against torch 2.15 for n = 1…299 while writing this, and by the fixture test.
fn linspace_f32(start: f32, end: f32, n: usize) -> Vec<f32> {
    if n == 1 {
        return vec![start];
    }
    let step = (end - start) / (n - 1) as f32;
    let half = n / 2;
    (0..n)
        .map(|i| {
            if i < half {
                step.mul_add(i as f32, start)
            } else {
                (-step).mul_add((n - 1 - i) as f32, end)
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn turbo_eight_steps_shape() {
        let s = Schedule::new(8, 3.0);
        assert_eq!(s.sigmas.len(), 9);
        assert_eq!(s.sigmas[0], 1.0);
        assert_eq!(*s.sigmas.last().unwrap(), 0.0);
        assert_eq!(s.model_t[0], 0.0);
        assert!(s.sigmas.windows(2).all(|w| w[0] > w[1]));
    }

    #[test]
    fn four_steps_known_values() {
        // s = [1, .75, .5, .25] → σ = 3s/(1+2s) = [1, .9, .75, .5]
        let s = Schedule::new(4, 3.0);
        assert_eq!(s.sigmas, vec![1.0, 0.9, 0.75, 0.5, 0.0]);
    }

    #[test]
    fn euler_step_negates_the_model_output() {
        let s = Schedule::new(4, 3.0);
        let mut x = vec![1.0f32, -2.0];
        s.step(0, &mut x, &[1.0, 1.0]);
        // dt = 0.9 − 1 = −0.1; x += −0.1 · (−1)
        assert!((x[0] - 1.1).abs() < 1e-6 && (x[1] + 1.9).abs() < 1e-6);
    }
}
