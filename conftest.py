"""Shared pytest setup: 8 virtual CPU devices before any JAX backend starts, and the
checks every package's test_doctests.py makes (`api_docs`)."""

import doctest
import re

import jax
import pytest

# Must run before the first backend use. It only shapes the CPU backend, so real
# accelerators (tpu_integration) are unaffected.
jax.config.update("jax_num_cpu_devices", 8)


class ApiDocs:
    """A package's docstring examples run, every public function has one, and its
    README's name list ("All functions and names (`__all__`): ...") is `__all__`."""

    @staticmethod
    def package_globs(package) -> dict:
        """The names the package docstring's example defines (its setup), for the
        examples of the package's modules to start from."""
        name = package.__name__
        test = doctest.DocTestParser().get_doctest(package.__doc__, {}, name, None, 0)
        runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
        runner.run(test, clear_globs=False)
        assert runner.failures == 0, f"{name}'s package docstring example fails"
        return test.globs

    @staticmethod
    def run_examples(module, extraglobs=None) -> None:
        result = doctest.testmod(module, extraglobs=extraglobs, optionflags=doctest.ELLIPSIS)
        assert result.attempted > 0, f"{module.__name__} has no docstring example"
        assert result.failed == 0

    @staticmethod
    def functions_without_example(package) -> list[str]:
        return [
            name
            for name in package.__all__
            if callable(getattr(package, name))
            and not isinstance(getattr(package, name), type)
            and ">>>" not in (getattr(package, name).__doc__ or "")
        ]

    @staticmethod
    def check_readme_lists_all(readme, package) -> None:
        text = readme.read_text()
        start = text.index("All functions and names (`__all__`):")
        paragraph = text[start : text.index("\n\n", start)]
        listed = re.findall(r"`([A-Za-z_0-9]+)`", paragraph.split(":", 1)[1])
        assert sorted(listed) == sorted(package.__all__)
        assert len(listed) == len(set(listed))


@pytest.fixture(scope="session")
def api_docs():
    return ApiDocs
