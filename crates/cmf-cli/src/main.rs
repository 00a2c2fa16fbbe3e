//! `cmf`: the command-line front end. This file only registers subcommands (one module each
//! under `commands/`) and turns their errors into messages and exit codes (see `exit`).

mod commands;
mod exit;
mod malloc_policy;
mod panic_hook;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "cmf",
    version,
    about = "CMF v2 models: inspect, verify, run",
    after_help = "Exit codes: 0 success, 1 runtime/IO error, 2 usage error, 3 verification failed."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    Info(commands::info::Args),
    Imagine(commands::imagine::Args),
    Verify(commands::verify::Args),
    Convert(commands::convert::Args),
    ImportGguf(commands::import_gguf::Args),
    Synth(commands::synth::Args),
    Run(commands::run::Args),
    Serve(commands::serve::Args),
    Bench(commands::bench::Args),
    Ppl(commands::ppl::Args),
    /// Renders chat templates for the parent `cmf` over stdin/stdout, with capped memory.
    #[command(name = commands::template_worker::COMMAND, hide = true)]
    TemplateWorker,
}

fn main() -> ExitCode {
    cmf_gpu::facade::log::mark_start();
    panic_hook::install();
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            // --help / --version print to stdout and succeed; real usage errors exit 2.
            let _ = e.print();
            return if e.use_stderr() {
                ExitCode::from(exit::USAGE)
            } else {
                ExitCode::SUCCESS
            };
        }
    };
    if !matches!(cli.command, Command::TemplateWorker) {
        commands::template_worker::install();
    }
    let result = match cli.command {
        Command::Info(args) => commands::info::run(args),
        Command::Imagine(args) => commands::imagine::run(args),
        Command::Convert(args) => commands::convert::run(args),
        Command::Verify(args) => commands::verify::run(args),
        Command::ImportGguf(args) => commands::import_gguf::run(args),
        Command::Synth(args) => commands::synth::run(args),
        Command::Run(args) => commands::run::run(args),
        Command::Serve(args) => commands::serve::run(args),
        Command::Bench(args) => commands::bench::run(args),
        Command::Ppl(args) => commands::ppl::run(args),
        Command::TemplateWorker => commands::template_worker::run(),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(exit::code_for(&e))
        }
    }
}
