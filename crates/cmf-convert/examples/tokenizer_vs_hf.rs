//! Compares the tokenizer rebuilt from a GGUF (e.g. one written by llama.cpp's
//! `convert_hf_to_gguf.py --vocab-only`) with the Hugging Face tokenizer.json it came from, on a
//! list of strings. usage: tokenizer_vs_hf FILE.gguf tokenizer.json
use cmf_convert::gguf::GgufFile;
use cmf_convert::import_gguf::tokenizer;

const TEXTS: &[&str] = &[
    "Hello world",
    " leading space",
    "trailing space ",
    "multiple   spaces    here",
    "line one\nline two\n\n\nline",
    "tab\tseparated",
    "digits 1234567890 and pi 3.14159",
    "Unicode: café naïve résumé Ærøskøbing",
    "中文字符测试，你好！",
    "emoji 🙂👍🏽 and flags 🇫🇷",
    "<|im_start|>user\nhi<|im_end|>",
    "text<|endoftext|>more",
    "fn main() { println!(\"hi {}\", 1 + 2); }",
    "I'm sure they'LL say WE'RE done",
    "Ελληνικά и русский текст",
    "   ",
    "\r\n\r\n",
    "a\u{00A0}b\u{2003}c",
    "x = [1,2,3]; // ok?!",
    "<think>\nreasoning\n</think>\n\nanswer",
];

fn main() {
    let mut args = std::env::args().skip(1);
    let (gguf, hf) = (
        args.next().expect("FILE.gguf"),
        args.next().expect("tokenizer.json"),
    );
    let g = GgufFile::open(gguf.as_ref()).unwrap();
    let rebuilt = tokenizer::rebuild(&g.gguf).unwrap();
    println!(
        "model {} pre {} tokens {}",
        rebuilt.model, rebuilt.pre, rebuilt.n_tokens
    );
    let ours =
        tokenizers::Tokenizer::from_bytes(serde_json::to_vec(&rebuilt.json).unwrap()).unwrap();
    let theirs = tokenizers::Tokenizer::from_file(hf).unwrap();
    let mut same = 0;
    for t in TEXTS {
        let a = ours.encode(*t, false).unwrap().get_ids().to_vec();
        let b = theirs.encode(*t, false).unwrap().get_ids().to_vec();
        if a == b {
            same += 1;
        } else {
            println!("DIFF {t:?}\n  rebuilt {a:?}\n  hf      {b:?}");
        }
    }
    println!("{same}/{} identical", TEXTS.len());
}
