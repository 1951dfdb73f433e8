"""The plugin machinery: the markers (:mod:`.markers`: ``@hookimpl``), every hook a plugin
can implement (:mod:`.hookspecs`), the built-in plugins (:mod:`.builtin`), the plugin
manager that finds, blocks, checks and traces plugins (:mod:`.manager`), and what the
plugins of a run share (:mod:`.shared`: ``trainer.shared``).

Plugin authors need only ``from ddpx import hookimpl``.
"""
