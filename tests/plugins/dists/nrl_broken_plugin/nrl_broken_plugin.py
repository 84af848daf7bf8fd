"""A plugin whose import fails: nrl must warn, name it, and load the others."""

raise RuntimeError("this plugin is broken on purpose")
