"""What a test reads of a child process's output."""


def own_lines(stderr):
    """stderr without the lines TensorFlow's C++ runtime prints at start-up (on CPUs with
    AVX-512, oneDNN's notice, whatever TF_CPP_MIN_LOG_LEVEL says)."""
    return [line for line in stderr.splitlines()
            if line.strip() and "absl::InitializeLog" not in line
            and not line.startswith(("I0000", "E0000", "W0000"))]
