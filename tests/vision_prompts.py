"""Image prompts for the vision-language targets' tests: Qwen-style prompts (Qwen3-VL, Qwen3.5) of random
patch rows, Hugging Face's `generate` on them, and the checks every such target's tests share."""

from __future__ import annotations

import numpy as np


def qwen_image_prompts(hf, n: int, seed: int = 11) -> list[tuple[list[int], np.ndarray, tuple]]:
    """(ids, pixel rows, grids): 1 or 2 images of random pixels and grids (8-pixel patches), text before,
    between and after, each image's tokens expanded as the processor does (start, one token per merged
    2x2 patch, end)."""
    c = hf.config
    rng = np.random.default_rng(seed)
    width = 3 * 2 * 8 * 8  # channels x temporal patch x 8 x 8 pixels
    text_top = min(c.image_token_id, c.video_token_id, c.vision_start_token_id, c.vision_end_token_id)
    out = []
    for i in range(n):
        grids = tuple((1, 2 * int(rng.integers(1, 4)), 2 * int(rng.integers(1, 4))) for _ in range(1 + i % 2))
        ids = list(map(int, rng.integers(2, text_top, int(rng.integers(1, 6)))))
        for g in grids:
            ids += [c.vision_start_token_id] + [c.image_token_id] * (int(np.prod(g)) // 4) + [c.vision_end_token_id]
            ids += list(map(int, rng.integers(2, text_top, int(rng.integers(0, 9)))))
        pixels = rng.standard_normal((sum(int(np.prod(g)) for g in grids), width)).astype(np.float32)
        out.append((ids, pixels, grids))
    return out


def qwen_hf_generate(hf, ids, pixels, grids, new_tokens: int) -> list[int]:
    import torch

    with torch.no_grad():
        out = hf.generate(
            torch.tensor([ids]),
            pixel_values=torch.from_numpy(pixels),
            image_grid_thw=torch.tensor(grids),
            mm_token_type_ids=(torch.tensor([ids]) == hf.config.image_token_id).int(),
            max_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(ids) :].tolist()


def agrees(engine, got: list[int], want: list[int], new_tokens: int) -> bool:
    """Our tokens are Hugging Face's (which runs on past an end-of-sequence token) up to where ours stopped."""
    return got == want[: len(got)] and (len(got) == new_tokens or got[-1] in engine.eos_token_ids)


def assert_image_sampling_same_seed(engine, cases, modes) -> None:
    """Same-seed sampled output of every mode == plain's, for (ids, ImagePrompt) cases."""
    for seed, (ids, images) in enumerate(cases):
        runs = {
            m: engine.generate(
                ids, mode=m, max_new_tokens=12, temperature=0.8, top_p=0.95, seed=seed, images=images
            ).tokens
            for m in modes
        }
        assert all(r == runs["plain"] for r in runs.values()), f"seed {seed}"


def assert_qwen_image_prompts_equal_hf(forms: dict, hf, n: int, new_tokens: int, modes) -> None:
    """`n` Qwen-style image prompts: every engine ({form: Engine}) in every mode == Hugging Face's generate."""
    for ids, pixels, grids in qwen_image_prompts(hf, n):
        want = qwen_hf_generate(hf, ids, pixels, grids, new_tokens)
        for form, engine in forms.items():
            images = engine.images.prompt(ids, pixels, np.array(grids))
            for mode in modes:
                got = engine.generate(ids, mode=mode, max_new_tokens=new_tokens, images=images).tokens
                assert agrees(engine, got, want, new_tokens), f"{form} {mode}, {len(grids)} image(s), grids {grids}"
