# The distributions under dists/ are installed by the tests that use them; their own tests run
# from there (test_installed_plugins.py), against the installed copy, as a plugin author runs them.
collect_ignore = ["dists"]
