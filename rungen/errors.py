"""The tool's exceptions: library code raises them; only run_generation.cli turns one into a line and an exit code."""


class RunGenerationError(Exception):
    """Bad input the tool cannot honour: a flag, a file, a model. Its message is one line; exit code 2."""

    exit_code = 2


class UsageError(RunGenerationError):
    """A flag, a combination of flags or a file they name that cannot be used."""


class GenerationError(RunGenerationError):
    """generate() refused the settings (a value only the library checks)."""


class PromptError(RunGenerationError):
    """One prompt that cannot be generated: it gets an error record and the others go on (the one --prompt: 2)."""


class PromptsFailed(RunGenerationError):
    """Some prompts could not be generated; each has its error record already. Exit code 1."""

    exit_code = 1


def one_line(error: BaseException) -> str:
    """An exception's message on one line (GenerationConfig's span a heading, '- ' items and a note)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    items = [line[2:] for line in lines if line.startswith("- ")]
    return " ".join(items or lines[:1]) or type(error).__name__


# What CUDA says when memory runs out outside torch's caching allocator: a context, a cuBLAS handle, a graph.
DEVICE_MEMORY_MESSAGES = ("CUDA error: out of memory", "CUBLAS_STATUS_ALLOC_FAILED", "cudaErrorMemoryAllocation")


def out_of_device_memory(error: BaseException) -> bool:
    """Whether `error` is a GPU running out of memory: torch's OutOfMemoryError, or CUDA's own error saying so."""
    return isinstance(error, RuntimeError) and (type(error).__name__ == "OutOfMemoryError"
                                                or any(message in str(error) for message in DEVICE_MEMORY_MESSAGES))
