"""Typed errors raised by k25.

Every error a user can cause is one of these classes, with a message that says what to do.
The C++ core throws k25::Error with a code; the bindings map each code to a class here.
"""


class K25Error(Exception):
    """Base class of every k25 error."""


class InvalidArgumentError(K25Error, ValueError):
    """A value k25 cannot accept (C++ code InvalidArgument)."""


class ConfigError(InvalidArgumentError):
    """A K25Config that asks for something this build or machine cannot do."""


class RequestError(InvalidArgumentError):
    """A bad request: wrong types, empty prompt, out-of-range sampling parameters."""


class PromptTooLongError(RequestError):
    """A prompt that does not fit max_seq_len."""


class ModelLoadError(K25Error):
    """A model that could not be loaded."""


class CorruptModelError(ModelLoadError):
    """A truncated or internally inconsistent model file (C++ code CorruptFile)."""


class UnsupportedModelError(ModelLoadError):
    """A valid file with an architecture, tensor type or option k25 does not support."""


class ModelNotFoundError(ModelLoadError, FileNotFoundError):
    """A model path, file, tensor or metadata key that does not exist (C++ code NotFound)."""


class ResourceExhaustedError(K25Error):
    """A request that can never fit (KV pool too small), or an engine that is full."""


class K25NotImplementedError(K25Error, NotImplementedError):
    """An option that is named in the API but not built yet."""


class K25IOError(K25Error, OSError):
    """The operating system refused a read, write or mapping."""


class EngineError(K25Error):
    """An internal failure of the engine (a bug); the request that hit it is failed."""


class BenchError(K25Error):
    """A serving benchmark (`k25 bench`) that cannot run: a bad workload or dataset, a server
    that cannot be reached or started."""


# C++ k25::ErrorCode name -> Python class (used by the bindings' exception translator).
BY_CODE = {
    "InvalidArgument": InvalidArgumentError,
    "CorruptFile": CorruptModelError,
    "Unsupported": UnsupportedModelError,
    "NotFound": ModelNotFoundError,
    "IOError": K25IOError,
    "ResourceExhausted": ResourceExhaustedError,
    "NotImplemented": K25NotImplementedError,
    "Internal": EngineError,
}
