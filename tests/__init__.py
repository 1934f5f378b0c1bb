"""The core's specification tests, laid out as the package: a folder per subpackage of flowgrpo/ (algo/, sampling/,
models/, training/, config/, rewards/, data/, tasks/, cli/), a file per top-level module here, bad input in inputs/,
the repository's docs/ and bench/ scripts in their folders. The reward plugins' tests are in rewards/tests/."""
