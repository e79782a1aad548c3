"""What the tests share besides fixtures: running flows and commands in a test's
project, starting and reading real servers, the functions ranks run on Dask workers,
scripts run as processes of their own (`python -m tests.helpers.<name>`). Imported as a
package; the conftest.py files hold only fixtures and pytest's hooks."""
